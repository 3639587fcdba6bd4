"""Fuzzed request bodies: valid ones with fields swapped for wrong types, odd shapes and values out of range
(nulls, bools, huge and negative ints, floats where ints go, NaN/Infinity, nested lists and dicts, empty and
long strings, token ids outside the vocabulary, odd roles and content parts, ...). Whatever the body, the
server answers below 500, every 4xx is an OpenAI error object naming a field of the request (or the body), a
stream ends with [DONE] and no server error, and once each request is answered (and its pins deleted) the engine
has nothing pending and no block held.
Image bytes are fuzzed on the media functions themselves (the tiny served model takes no images)."""

from __future__ import annotations

import base64
import json
import math
import re
import time
import urllib.parse
from collections.abc import Collection, Iterator
from typing import Any

import httpx
import pytest
from helpers import fail_first_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.server.media import MediaOptions, decode_image, read_image_bytes
from kvpool.server.serve import ServerHandle

VOCAB = 49152
COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PIN = {"prompt": list(range(100, 100 + 20))}
SETTINGS = settings(max_examples=250, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

INTS = st.sampled_from([0, 1, 2, -1, -2, 3, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400])
FLOATS = st.one_of(st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.5, 2.0, -1.0, 1e-5, 1e-300, 5e-324, 1e308, -1e308,
                                    math.nan, math.inf, -math.inf]),
                   st.floats(allow_nan=False, allow_infinity=False, width=64))
TEXT = st.one_of(st.sampled_from(["", " ", "a", "\x00", "\ufffd", "é🙂中", "\u202e", "a" * 5000, "<|im_end|>",
                                  "{{ raise_exception('x') }}", "%s%n", "\\u0000"]),
                 st.text(max_size=30))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=3))


ANY = st.recursive(SCALARS, _nested, max_leaves=8)
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 300), st.sampled_from([VOCAB - 1, VOCAB, -1, 2**63, 10**30])),
                     max_size=12)
PROMPTS = st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, max_size=3), st.lists(TOKEN_IDS, max_size=3),
                    st.lists(st.lists(TOKEN_IDS, max_size=2), max_size=2), st.just(list(range(600))))
# (Never None, nor dropped: a request would then run to the end of the context, which takes seconds here.)
MAX_TOKENS = st.one_of(st.integers(1, 4),
                       st.sampled_from([0, -1, True, 2.0, 1.5, "2", 10**6, 2**64, 10**400, [2], {}]))
IMAGE_URLS = st.one_of(TEXT, st.sampled_from(["data:image/png;base64,AAAA", "data:,", "data:image/png;base64,",
                                              "http://example.com/x.png", "file:///etc/passwd",
                                              "data:text/plain;base64,aGk=", "data:image/png;base64,!!!"]))
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(TEXT, SCALARS)}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.one_of(st.fixed_dictionaries({"url": IMAGE_URLS}), SCALARS,
                                                  st.fixed_dictionaries({"url": IMAGE_URLS, "detail": SCALARS}))}),
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["text", "image_url", "input_audio", "image", ""]),
                                             SCALARS)}),
    SCALARS)
ROLES = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "", "USER"]),
                  SCALARS)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": ROLES, "content": st.one_of(TEXT, st.lists(PART, max_size=3), SCALARS)},
                          optional={"name": SCALARS, "tool_calls": ANY, "tool_call_id": SCALARS}),
    ANY)
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=4), MESSAGE, SCALARS)
STOP = st.one_of(TEXT, st.lists(TEXT, max_size=5), st.lists(ANY, max_size=3), SCALARS)

# Values a field may well hold (so that requests get past validation and into the engine), and odd ones.
SMALL_FLOATS = st.floats(0, 2, allow_nan=False)
CONTENT = st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3))
GOOD_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant",
                                                                         "tool"]),
                                                "content": st.one_of(CONTENT, st.none())}), min_size=1, max_size=4)


def field(good: st.SearchStrategy[Any], odd: st.SearchStrategy[Any] = SCALARS) -> st.SearchStrategy[Any]:
    """A good value or an odd one, even odds (st.one_of would weigh each of the odd ones' branches as much)."""
    return st.sampled_from([good, odd]).flatmap(lambda s: s)


# The fields of a request, each with values aimed at its type and range (and any value at all sometimes).
SAMPLING = {
    "model": field(st.just("tiny"), st.one_of(TEXT, SCALARS)),
    "max_tokens": MAX_TOKENS,
    "temperature": field(SMALL_FLOATS, FLOATS),
    "top_p": field(st.floats(0, 1, exclude_min=True), FLOATS),
    "top_k": field(st.integers(-1, 60000), INTS),
    "n": field(st.sampled_from([1, 1, 2, 3]), INTS),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                            st.one_of(st.fixed_dictionaries({}, optional={"include_usage": SCALARS, "extra": ANY}),
                                      ANY)),
    "stop": field(st.one_of(TEXT, st.lists(TEXT, max_size=5)), st.one_of(st.lists(ANY, max_size=3), SCALARS)),
    "seed": field(st.integers(-(2**63), 2**64 - 1), INTS),
    "frequency_penalty": field(st.just(0), FLOATS),
    "presence_penalty": field(st.just(0.0), FLOATS),
    "logprobs": field(st.sampled_from([None, False, 0, True, 1, 5]), ANY),
    "prompt_logprobs": field(st.sampled_from([None, 0, 2]), ANY),
    "top_logprobs": field(st.sampled_from([None, 0, 1]), INTS),
    "best_of": field(st.sampled_from([None, 1, 2]), INTS),
    "logit_bias": field(st.one_of(st.just({}), st.dictionaries(st.sampled_from(["5", "-1", "x", str(VOCAB)]),
                                                               FLOATS, max_size=2)), ANY),
    "response_format": field(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
                             ANY),
    "tools": field(st.just([]), ANY),
    "tool_choice": field(st.sampled_from(["none", "auto", "required"]), ANY),
    "min_p": field(st.sampled_from([0, 0.0, 0.1]), FLOATS),
    "min_tokens": field(st.sampled_from([0, 1]), INTS),
    "repetition_penalty": field(st.sampled_from([1, 1.0, 1.1]), FLOATS),
    "ignore_eos": field(st.booleans()),
    "stop_token_ids": field(TOKEN_IDS, st.one_of(st.lists(ANY, max_size=3), SCALARS)),
    "include_stop_str_in_output": field(st.booleans()),
    "cache_salt": field(TEXT),
    "user": ANY,
    "metadata": ANY,
}
FIELDS = {
    "/v1/completions": {**SAMPLING, "prompt": PROMPTS, "echo": field(st.booleans()), "suffix": field(TEXT)},
    "/v1/chat/completions": {**SAMPLING, "messages": field(GOOD_MESSAGES, MESSAGES),
                             "max_completion_tokens": MAX_TOKENS},
    "/v1/pins": {"prompt": field(st.just(list(range(100, 100 + 16 * 3))), PROMPTS),
                 "messages": field(GOOD_MESSAGES, MESSAGES),
                 "ttl": field(st.floats(0, 1e6), st.one_of(FLOATS, INTS, SCALARS)),
                 "cache_salt": field(TEXT), "extra": ANY},
}
BASES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/v1/pins": PIN}
DELETE = object()  # a mutation that drops the field


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """An endpoint, and its valid body with one to six fields replaced, added or dropped."""
    path = draw(st.sampled_from(sorted(BASES)))
    body = dict(BASES[path])
    fields = FIELDS[path]
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=6, unique=True)):
        value = draw(st.one_of(fields[name], st.just(DELETE), ANY) if draw(st.integers(0, 9)) == 0
                     else fields[name])
        if value is DELETE and name != "max_tokens":
            body.pop(name, None)
        elif value is not DELETE:
            body[name] = value
    if path == "/v1/pins" and "messages" in body and draw(st.booleans()):
        body.pop("prompt", None)  # (a pin takes one of the two: mostly the messages alone)
    return path, body


def assert_openai_error(r: httpx.Response, fields: Collection[str] | None = None) -> None:
    """An OpenAI error object; with `fields`, one that names a field of the request (its `param`, else the
    start of its message), or the body as a whole, never a name of the engine's own (`prompt_token_ids`)."""
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    assert err["code"] == r.status_code and (err["param"] is None or isinstance(err["param"], str)), err
    if fields is not None:
        named = err["param"] or err["message"].split(":", 1)[0]
        assert re.split(r"[.\[]", named)[0] in {*fields, "body"}, err


def check_stream(r: httpx.Response) -> None:
    """Events up to [DONE]; an error event (a refusal once the stream began) is a client error's object."""
    events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    for e in events[:-1]:
        err = json.loads(e).get("error")
        assert err is None or (set(err) == {"message", "type", "param", "code"} and err["code"] < 500), err


def settle(server: ServerHandle, client: httpx.Client) -> None:
    """Delete every pin, wait for aborted streams to be dropped, then check what the other server tests check
    after bad input: nothing pending, the KV cache's integrity, no block in use."""
    for pin in client.get(f"{server.url}/v1/pins").json()["data"]:
        assert client.delete(f"{server.url}/v1/pins/{pin['id']}").status_code in (200, 404)
    deadline = time.monotonic() + 10
    while server.engine.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.engine.num_pending == 0
    server.engine.call_soon(lambda e: e.kv.check_integrity()).result(10)
    assert server.engine.call_soon(lambda e: e.kv.usage).result(10) == 0.0


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


@SETTINGS
@given(req=requests())
def test_fuzzed_bodies_never_get_a_server_error(server: ServerHandle, client: httpx.Client,
                                                req: tuple[str, dict[str, Any]]) -> None:
    path, body = req
    raw = json.dumps(body).encode()  # NaN/Infinity go out as the literals JSON does not have
    with client.stream("POST", f"{server.url}{path}", content=raw,
                       headers={"content-type": "application/json"}) as r:
        assert r.status_code < 500, (r.status_code, r.read())
        if r.status_code >= 400:
            r.read()
            assert_openai_error(r, FIELDS[path])
        elif r.headers["content-type"].startswith("text/event-stream"):
            check_stream(r)
        else:
            r.read()
            r.json()
    settle(server, client)


@settings(max_examples=30, deadline=None, database=None)
@given(pin_id=st.one_of(TEXT.filter(lambda s: s.strip(".") != ""), st.just("pin-1")),
       ttl=st.one_of(st.none(), st.floats(1e-9, 1e308)),
       reset_body=st.one_of(st.none(), st.binary(max_size=20)))
def test_fuzzed_pin_ids_and_resets(server: ServerHandle, client: httpx.Client, pin_id: str, ttl: float | None,
                                   reset_body: bytes | None) -> None:
    """Unpinning an id that names no pin is a 404 (or, for an id with a '/' in it, no route: 404 or 405); a reset with a
    pin standing computes it again; deleting it then frees every block."""
    pin = client.post(f"{server.url}/v1/pins", json={**PIN, "ttl": ttl})
    assert pin.status_code == 200, pin.text
    r = client.delete(f"{server.url}/v1/pins/{urllib.parse.quote(pin_id, safe='')}")
    if r.status_code != 307:  # (a path ending in '/' is redirected to the one without, as Starlette does)
        assert r.status_code in (404, 405), r.text
        assert_openai_error(r)
    r = client.post(f"{server.url}/reset_prefix_cache", content=reset_body)
    assert r.status_code == 200 and r.json() == {"reset": True}, r.text
    for path in ("/v1/models", "/v1/pins", "/health", "/metrics"):
        assert client.get(f"{server.url}{path}").status_code == 200
    settle(server, client)


def test_pinned_messages_with_an_image_are_refused(server: ServerHandle, client: httpx.Client) -> None:
    """A pin is of text: its image dropped, it would hold tokens no chat with the image starts with (it was
    pinned so, answering 200)."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = client.post(f"{server.url}/v1/pins", json={"messages": [
        {"role": "system", "content": "x " * 40}, {"role": "user", "content": [{"type": "text", "text": "a"}, part]}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[1].content[1].image_url"
    assert r.json()["error"]["message"].startswith("messages[1].content[1].image_url: a pinned prefix is text only")
    settle(server, client)


def test_a_template_failure_is_a_400_for_pins_as_for_chats(server: ServerHandle, client: httpx.Client,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat template that fails with a Python error of its own (not jinja's TemplateError) was a 500 on
    /v1/pins while /v1/chat/completions answered 400 naming `messages`."""

    def broken(*_: object, **__: object) -> list[int]:
        raise TypeError('can only concatenate str (not "int") to str')

    monkeypatch.setattr(server.engine.engine.tokenizer, "apply_chat_template", broken)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/pins", {"messages": CHAT["messages"]})):
        r = client.post(f"{server.url}{path}", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages"
        assert r.json()["error"]["message"].startswith("messages: the chat template refused them: can only")
    monkeypatch.undo()
    settle(server, client)


def test_an_error_in_a_stream_is_an_openai_error_object(server: ServerHandle, client: httpx.Client) -> None:
    """Once a stream has begun, an error is an event holding the same object as an error response (it had no
    `param`)."""
    fail_first_step(server.engine.engine)
    with client.stream("POST", f"{server.url}/v1/completions", json={**COMPLETION, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    err = events[-1]["error"]
    assert err["code"] == 503 and err["type"] == "service_unavailable" and err["param"] is None
    assert "kernel exploded" in err["message"]
    settle(server, client)


PNG_1PX = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJ"
                           "RU5ErkJggg==")


@settings(max_examples=200, deadline=None, database=None)
@given(raw=st.one_of(st.binary(max_size=64), st.builds(lambda i, b: PNG_1PX[:i] + b + PNG_1PX[i + len(b):],
                                                       st.integers(0, len(PNG_1PX)), st.binary(max_size=8))),
       media_type=st.sampled_from(["image/png", "image/gif", "", "IMAGE/JPEG", "text/plain"]),
       mangle=st.sampled_from(["", "=", "==", "\n", "!", "===="]))
def test_fuzzed_image_data_is_refused_by_path(raw: bytes, media_type: str, mangle: str) -> None:
    """Any data URL either decodes to an image or is a ValueError naming the part; nothing else escapes."""
    where = "messages[0].content[1].image_url"
    url = f"data:{media_type};base64,{base64.b64encode(raw).decode()}{mangle}"
    try:
        decode_image(read_image_bytes(url, where, MediaOptions()), where, MediaOptions(max_image_pixels=1 << 16))
    except ValueError as e:
        assert str(e).startswith(f"{where}: "), e
