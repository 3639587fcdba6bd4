"""Parse an HTTP request body into a JSON object, or say exactly why it is not one.

Every way a body can be malformed is a `BodyError` whose message starts with "body:" (the server turns
it into an HTTP 400 with an OpenAI error object), never an exception that escapes as a 500:
a Content-Type that is not JSON, bytes that are not UTF-8, invalid JSON, nesting deeper than the parser
can follow (Python's decoder raises RecursionError, not JSONDecodeError), integers past Python's
int-from-string digit limit (a plain ValueError), NaN/Infinity literals (JSON has none; Python's
decoder accepts them), strings holding lone UTF-16 surrogates (valid JSON escapes that no tokenizer
can encode), and a top-level value that is not an object.

The Content-Type rule is FastAPI's: no header means JSON; `application/json` and `application/*+json`
are JSON; anything else (e.g. the `application/x-www-form-urlencoded` that `curl -d` sends without `-H`)
is refused rather than guessed at.
"""

from __future__ import annotations

import email.message
import json
import re
from typing import Any

import numpy as np

# Nesting deeper than this is refused before parsing. Python's C decoder would fail near its recursion
# limit (~1000) anyway; an explicit bound gives the same answer on every thread and stack size.
MAX_DEPTH = 128


class BodyError(ValueError):
    """A body that is not a JSON object; the message names the problem ("body: ...")."""


def check_content_type(content_type: str | None) -> None:
    if not content_type:
        return
    msg = email.message.Message()
    msg["content-type"] = content_type
    sub = msg.get_content_subtype()
    if msg.get_content_maintype() != "application" or not (sub == "json" or sub.endswith("+json")):
        raise BodyError(f"body: Content-Type must be application/json, got {content_type!r}")


# A JSON string (escapes included), or a run of characters that are neither brackets nor quotes.
_NOT_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[^\[\]{}"]+')


def _nesting_depth(text: str) -> int:
    """The deepest bracket nesting outside strings: strings and other characters dropped by a regex, then a
    running sum over the brackets (vectorised: a hostile body may be megabytes of brackets)."""
    brackets = np.frombuffer(_NOT_BRACKETS.sub("", text).replace('"', "").encode(), dtype=np.uint8)
    if not brackets.size:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def _refuse_constant(name: str) -> float:
    raise BodyError(f"body: invalid JSON ({name} is not a JSON number)")


def _finite_float(s: str) -> float:
    v = float(s)
    if v in (float("inf"), float("-inf")):
        raise BodyError(f"body: invalid JSON (number {s[:40]} is out of range)")
    return v


def parse_json_object(raw: bytes, content_type: str | None = None) -> dict[str, Any]:
    """The body as a dict; BodyError naming the problem otherwise."""
    check_content_type(content_type)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"body: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    # Only bodies with many brackets can be deep: skip the scan for the common case.
    if text.count("[") + text.count("{") > MAX_DEPTH and _nesting_depth(text) > MAX_DEPTH:
        raise BodyError(f"body: JSON nested deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except BodyError:
        raise
    except json.JSONDecodeError as e:
        raise BodyError(f"body: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise BodyError(f"body: JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # e.g. an integer with more digits than int() converts
        raise BodyError(f"body: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BodyError("body: must be a JSON object")
    try:
        # A lone surrogate (e.g. "\ud800") is a valid JSON escape but not text: UTF-8 cannot encode it.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise BodyError(f"body: a string holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!a})") from None
    return data
