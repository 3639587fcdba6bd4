"""Every malformed body is an HTTP 400 with an OpenAI error object naming the problem, never a 500: deep
nesting (a RecursionError inside Python's JSON decoder), numbers JSON does not have, integers past Python's
digit limit, lone surrogates, a non-JSON Content-Type, a non-object body, wrong field types (validated
strictly, not coerced) and a seed torch cannot take. The server keeps serving and holds no blocks after."""

from __future__ import annotations

import json

import httpx
import pytest

from kvpool.server.serve import ServerHandle

OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JSON = "application/json"


def body(base: dict | None = None, **kw: object) -> bytes:
    return json.dumps({**(base or OK), **kw}).encode()


DEEP = b'{"prompt": "hi", "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"
CASES = [
    # (path, raw body, content type, param, exact message)
    ("/v1/completions", DEEP, JSON, None, "body: JSON nested deeper than 128 levels"),
    ("/v1/chat/completions", b'{"messages": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}", JSON, None,
     "body: JSON nested deeper than 128 levels"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', JSON, None,
     "body: invalid JSON (NaN is not a JSON number)"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": -Infinity}', JSON, None,
     "body: invalid JSON (-Infinity is not a JSON number)"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e400}', JSON, None,
     "body: invalid JSON (number 1e400 is out of range)"),
    ("/v1/completions", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", JSON, None,
     "body: invalid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits; "
     "use sys.set_int_max_str_digits() to increase the limit)"),
    ("/v1/completions", b'{"prompt": "a \\ud800 b"}', JSON, None,
     "body: a string holds a lone UTF-16 surrogate ('\\ud800')"),
    ("/v1/completions", b"\xef\xbb\xbf" + body(), JSON, None,
     "body: invalid JSON (Unexpected UTF-8 BOM (decode using utf-8-sig) at line 1 column 1)"),
    ("/v1/completions", b"", JSON, None, "body: invalid JSON (Expecting value at line 1 column 1)"),
    ("/v1/completions", b"null", JSON, None, "body: must be a JSON object"),
    ("/v1/chat/completions", b'"hi"', JSON, None, "body: must be a JSON object"),
    ("/v1/completions", body(), "text/plain", None, "body: Content-Type must be application/json, got 'text/plain'"),
    ("/v1/chat/completions", body(CHAT), "application/x-www-form-urlencoded", None,
     "body: Content-Type must be application/json, got 'application/x-www-form-urlencoded'"),
    ("/v1/pins", b'{"prompt": ' + b"[" * 200 + b"]" * 200 + b"}", JSON, None,
     "body: JSON nested deeper than 128 levels"),
    # Wrong types are refused, not coerced ("yes" is no boolean, "5" no integer, 2.0 no token count).
    ("/v1/completions", body(stream="yes"), JSON, "stream", "stream: Input should be a valid boolean"),
    ("/v1/completions", body(seed="5"), JSON, "seed", "seed: Input should be a valid integer"),
    ("/v1/completions", body(max_tokens=2.0), JSON, "max_tokens", "max_tokens: Input should be a valid integer"),
    ("/v1/completions", body(stop_token_ids="7"), JSON, "stop_token_ids",
     "stop_token_ids: Input should be a valid list"),
    ("/v1/chat/completions", body(CHAT, messages={"role": "user"}), JSON, "messages",
     "messages: Input should be a valid list"),
    ("/v1/chat/completions", body(CHAT, messages=[{"role": "user", "content": {"text": "hi"}}]), JSON,
     "messages[0].content", "messages[0].content: Input should be a valid string / Input should be a valid list"),
    # A seed torch's generators cannot take used to fail on the engine thread (HTTP 500).
    ("/v1/completions", body(seed=2**70), JSON, "seed",
     f"seed: must be an int in [-2**63, 2**64), got {2**70}"),
]


@pytest.mark.parametrize(("path", "raw", "ctype", "param", "message"), CASES,
                         ids=[f"{i}-{c[4][:40]}" for i, c in enumerate(CASES)])
def test_malformed_body_is_a_400(server: ServerHandle, path: str, raw: bytes, ctype: str, param: str | None,
                                 message: str) -> None:
    r = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": ctype}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                  "code": 400}}
    ok = httpx.post(f"{server.url}/v1/completions", content=body(), headers={"content-type": JSON}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert server.engine.num_pending == 0
    assert server.engine.call_soon(lambda e: e.kv.usage).result(10) == 0.0


@pytest.mark.parametrize("ctype", [None, "application/json; charset=utf-8", "application/vnd.kvpool+json"])
def test_json_content_types_are_accepted(server: ServerHandle, ctype: str | None) -> None:
    headers = {"content-type": ctype} if ctype else {}  # no header at all: JSON, as FastAPI assumes
    r = httpx.post(f"{server.url}/v1/completions", content=body(), headers=headers, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_moderate_nesting_in_an_ignored_field_is_fine(server: ServerHandle) -> None:
    # 100 levels is under the limit: the field is ignored and the request runs.
    raw = b'{"prompt": "hello", "max_tokens": 2, "metadata": ' + b"[" * 100 + b"]" * 100 + b"}"
    r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"content-type": JSON}, timeout=30)
    assert r.status_code == 200, r.text
