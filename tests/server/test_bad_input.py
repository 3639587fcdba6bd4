"""Bad input never takes the server down: each case gets an OpenAI-style error with the right status and a
message naming the problem, nothing leaks, and the server answers normally afterwards."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import fail_first_step
from server_helpers import leave_early, make_engine, metric

from kvpool.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    StepReport,
)
from kvpool.engine.sampling_params import SamplingParams
from kvpool.server.errors import APIError, check_api_key
from kvpool.server.serve import ServerHandle, start_server

OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def body(**kw: object) -> bytes:
    return json.dumps({**OK, **kw}).encode()


CASES = [
    # (path, raw body, status, param, message fragment)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None, "body: invalid JSON"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "body: not valid UTF-8"),
    ("/v1/completions", b'["hi"]', 400, None, "body: must be a JSON object"),
    ("/v1/completions", body(model="gpt-9"), 404, "model", "The model `gpt-9` does not exist"),
    ("/v1/completions", body(prompt=""), 400, "prompt", "prompt: must not be empty"),
    ("/v1/completions", body(prompt=[]), 400, "prompt", "prompt: must not be empty"),
    ("/v1/completions", body(prompt=None), 400, "prompt", "prompt:"),
    # A batch: the prompt at fault by its place (those before it, already queued, are aborted).
    ("/v1/completions", body(prompt=["a", ""]), 400, "prompt[1]", "prompt[1]: must not be empty"),
    ("/v1/completions", body(prompt=[[1, 2], [1, 10**6]]), 400, "prompt[1]", "prompt[1]: token ids must be in"),
    ("/v1/completions", body(prompt=[[1, 2], list(range(600))]), 400, "prompt[1]", "the context holds 512"),
    ("/v1/completions", body(prompt=["a"] * 257), 400, "prompt", "prompt: a batch holds at most 256 prompts"),
    ("/v1/completions", body(prompt=[1, -2]), 400, "prompt", "greater than or equal to 0"),
    ("/v1/completions", body(prompt=[1, 10**6]), 400, "prompt", "prompt: token ids must be in [0, 49152)"),
    ("/v1/completions", body(prompt=list(range(600))), 400, "prompt", "the context holds 512"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "user", "content": "hi " * 600}]}).encode(),
     400, "messages", "messages: the prompt has"),
    ("/v1/completions", body(max_tokens=0), 400, "max_tokens", "max_tokens: must be an int >= 1"),
    ("/v1/completions", body(max_tokens=-5), 400, "max_tokens", "max_tokens: must be an int >= 1"),
    ("/v1/completions", body(max_tokens=10_000), 400, "max_tokens", "max_tokens"),
    ("/v1/completions", body(max_tokens="many"), 400, "max_tokens", "max_tokens: Input should be a valid integer"),
    ("/v1/completions", body(temperature=-1), 400, "temperature", "temperature: must be >= 0"),
    ("/v1/completions", body(top_p=2), 400, "top_p", "top_p: must be in (0, 1]"),
    ("/v1/completions", body(top_k=-3), 400, "top_k", "top_k"),
    ("/v1/completions", body(n=129), 400, "n", "n: must be an int in [1, 128]"),
    ("/v1/completions", body(seed="x"), 400, "seed", "seed: Input should be a valid integer"),
    ("/v1/completions", body(stop=[""]), 400, "stop", "stop: every stop string"),
    ("/v1/completions", body(stop=["x"] * 65), 400, "stop", "stop: at most 64 stop strings, got 65"),
    ("/v1/completions", body(logprobs=21), 400, "logprobs", "logprobs: must be an int in [0, 20]"),
    ("/v1/completions", body(logprobs=True), 400, "logprobs", "logprobs: must be an int in [0, 20]"),
    ("/v1/chat/completions", json.dumps({**CHAT, "logprobs": 3}).encode(), 400, "logprobs",
     "logprobs: must be true or false, got 3"),
    ("/v1/chat/completions", json.dumps({**CHAT, "top_logprobs": 2}).encode(), 400, "top_logprobs",
     "top_logprobs: needs logprobs: true"),
    ("/v1/chat/completions", json.dumps({**CHAT, "logprobs": True, "top_logprobs": 21}).encode(), 400, "top_logprobs",
     "top_logprobs: must be an int in [0, 20], got 21"),
    ("/v1/completions", body(presence_penalty=2.5), 400, "presence_penalty", "presence_penalty: must be in [-2, 2]"),
    ("/v1/completions", body(return_token_ids=2), 400, "return_token_ids", "return_token_ids: Input should be a valid"),
    ("/v1/completions", body(stream=True, stream_options={"include_usage": True, "every_chunk": True}), 400,
     "stream_options.every_chunk", "stream_options.every_chunk: Extra inputs are not permitted"),
    ("/v1/completions", body(cache_salt=""), 400, "cache_salt", "cache_salt"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": []}).encode(), 400, "messages", "messages"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400,
     "messages[0].role", "messages[0].role"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "user", "content": 5}]}).encode(), 400,
     "messages[0].content", "messages[0].content"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]}).encode(), 400, "messages[1].tool_calls",
     "messages[1].tool_calls: not supported (kvpool serves no tools)"),
    ("/v1/chat/completions", json.dumps({**CHAT, "max_completion_tokens": 0}).encode(), 400, "max_completion_tokens",
     "max_completion_tokens: must be an int >= 1"),
    ("/v1/chat/completions", json.dumps({**CHAT, "max_completion_tokens": 10**6}).encode(), 400,
     "max_completion_tokens", "max_completion_tokens: 1000000 new tokens"),
    ("/v1/chat/completions", json.dumps({**CHAT, "max_tokens": -5, "max_completion_tokens": 2}).encode(), 400,
     "max_tokens", "max_tokens: must be an int >= 1, got -5"),
    ("/v1/completions", body(stream_options={"include_usage": True}), 400, "stream_options",
     "stream_options: only with stream=true"),
    # Fields that would change the answer and are not implemented: refused by name, never ignored.
    ("/v1/completions", body(best_of=2), 400, "best_of", "best_of: not supported"),
    ("/v1/completions", body(logit_bias={"x": 100}), 400, "logit_bias", "logit_bias: keys are token ids, got 'x'"),
    ("/v1/completions", body(logit_bias={"²": 1}), 400, "logit_bias", "logit_bias: keys are token ids, got '²'"),
    ("/v1/completions", body(logit_bias={"9" * 5000: 1}), 400, "logit_bias", "logit_bias: keys are token ids"),
    ("/v1/completions", body(logit_bias={"5": 101}), 400, "logit_bias", "logit_bias: 5: a bias in [-100, 100]"),
    ("/v1/completions", body(logit_bias={"49152": 1}), 400, "logit_bias",
     "logit_bias: token ids must be in [0, 49152)"),
    ("/v1/completions", body(min_p=1.5), 400, "min_p", "min_p: must be in [0, 1], got 1.5"),
    ("/v1/completions", body(repetition_penalty=0), 400, "repetition_penalty",
     "repetition_penalty: must be > 0 (1: off)"),
    ("/v1/chat/completions", json.dumps({**CHAT, "response_format": {"type": "xml"}}).encode(), 400,
     "response_format", "response_format: type must be one of text, json_object, json_schema, got 'xml'"),
    ("/v1/chat/completions", json.dumps({**CHAT, "response_format": {"type": "json_schema"}}).encode(), 400,
     "response_format", "response_format: json_schema needs"),
    ("/v1/chat/completions", json.dumps({**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nothing"}}}}).encode(), 400,
     "response_format", "response_format: "),
    ("/v1/completions", body(guided_regex="[a-"), 400, "guided_regex", "guided_regex: invalid regex"),
    ("/v1/completions", body(guided_choice=[]), 400, "guided_choice", "guided_choice: a non-empty list of strings"),
    ("/v1/completions", body(guided_json="{oops"), 400, "guided_json", "guided_json: not JSON"),
    ("/v1/completions", body(guided_grammar="start: ("), 400, "guided_grammar", "guided_grammar: "),
    ("/v1/completions", body(guided_regex="a", response_format={"type": "json_object"}), 400, "guided_regex",
     "guided_regex: give one of response_format, structured_outputs"),
    # (chat's handler names the fields before anything else: once a 500, which a router counts as a dead replica)
    ("/v1/chat/completions", json.dumps({**CHAT, "guided_regex": "a", "response_format": {"type": "json_object"}}
                                        ).encode(), 400, "guided_regex", "guided_regex: give one of"),
    ("/v1/chat/completions", json.dumps({**CHAT, "guided_json": {"$ref": "#"}}).encode(), 400, "guided_json",
     "guided_json: no text satisfies it"),
    ("/v1/completions", body(guided_json={"type": "integer", "maximum": 10**20}), 400, "guided_json",
     "guided_json: "),
    ("/v1/completions", body(structured_outputs={"regex": "a", "colour": 1}), 400, "structured_outputs",
     "structured_outputs: unknown field 'colour'"),
    ("/v1/completions", body(structured_outputs={"regex": "a", "whitespace_pattern": " "}), 400,
     "structured_outputs.whitespace_pattern", "structured_outputs.whitespace_pattern: not supported"),
    ("/v1/completions", body(structured_outputs={}), 400, "structured_outputs",
     "structured_outputs: exactly one of json, regex, choice, grammar, json_object must be set"),
    ("/v1/completions", body(guided_whitespace_pattern=" "), 400, "guided_whitespace_pattern", "not supported"),
    ("/v1/chat/completions", json.dumps({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}).encode(),
     400, "tools", "tools: not supported"),
    ("/v1/completions", body(use_beam_search=True), 400, "use_beam_search", "use_beam_search: not supported"),
    ("/v1/completions", body(skip_special_tokens="maybe"), 400, "skip_special_tokens", "skip_special_tokens:"),
    ("/v1/completions", body(bad_words=["ok", " "]), 400, "bad_words", "bad_words: every entry must be a string"),
    ("/v1/completions", body(allowed_token_ids=[]), 400, "allowed_token_ids", "allowed_token_ids: a non-empty list"),
    ("/v1/completions", body(allowed_token_ids=[5, 10**7]), 400, "allowed_token_ids",
     "allowed_token_ids: token ids must be in [0, "),
    ("/v1/completions", body(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens: an int >= 1, or -1"),
    ("/v1/completions", body(max_completion_tokens=3), 400, "max_completion_tokens", "max_completion_tokens: not"),
    ("/v1/chat/completions", json.dumps({**CHAT, "continue_final_message": True}).encode(), 400,
     "continue_final_message", "continue_final_message: true leaves the last message open"),
    ("/v1/completions", body(continue_final_message=True), 400, "continue_final_message",
     "continue_final_message: not supported"),
    ("/v1/chat/completions", json.dumps({**CHAT, "chat_template": "{{ 1 }}"}).encode(), 400, "chat_template",
     "chat_template: a request's own chat template needs a server started with --trust-request-chat-template"),
    ("/tokenize", json.dumps({"messages": CHAT["messages"], "chat_template": "{{ 1 }}"}).encode(), 400,
     "chat_template", "chat_template: a request's own chat template needs"),
    ("/v1/completions", body(chat_template="{{ 1 }}"), 400, "chat_template", "chat_template: not supported"),
    ("/v1/completions", b"x" * (65 << 10), 413, None, "body:"),
    ("/v1/nothing-here", body(), 404, None, "Not Found"),
]


def test_null_is_the_default_for_a_field_that_takes_no_null(server: ServerHandle) -> None:
    """OpenAI's API reads an explicit null as "not sent" (clients that serialize every field send them); where
    null is a value of its own (max_tokens: no bound but the context's) it keeps its meaning."""
    nulls = dict.fromkeys(("n", "stream", "frequency_penalty", "presence_penalty", "ignore_eos",
                           "include_stop_str_in_output", "temperature", "seed", "stop", "logprobs", "user"))
    want = httpx.post(f"{server.url}/v1/completions", json=OK, timeout=60).json()["choices"][0]["text"]
    for path, req in (("/v1/completions", {**OK, **nulls, "echo": None, "suffix": None}),
                      ("/v1/chat/completions", {**CHAT, **nulls, "temperature": 0, "max_completion_tokens": None})):
        r = httpx.post(f"{server.url}{path}", json=req, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert httpx.post(f"{server.url}/v1/completions", json={**OK, **nulls, "temperature": 0}, timeout=60).json()[
        "choices"][0]["text"] == want
    unbounded = {**OK, "max_tokens": None, "ignore_eos": True}
    usage = httpx.post(f"{server.url}/v1/completions", json=unbounded, timeout=120).json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 512  # (the context's end, not the default 16)


@pytest.mark.parametrize(("path", "raw", "status", "param", "fragment"), CASES,
                         ids=[f"{c[2]}-{c[4][:30]}" for c in CASES])
def test_bad_input_gets_an_openai_error(server: ServerHandle, path: str, raw: bytes, status: int,
                                        param: str | None, fragment: str) -> None:
    r = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"]
    assert err["code"] == status and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param
    # Still serving, nothing left behind.
    ok = httpx.post(f"{server.url}/v1/completions", content=body(), headers={"content-type": "application/json"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert server.engine.num_pending == 0
    assert server.engine.call_soon(lambda e: e.kv.usage).result(10) == 0.0


def test_huge_body_announced_by_content_length_is_refused_before_reading(server: ServerHandle) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        yield b"a" * (1 << 20)  # httpx streams this with chunked encoding: the limit applies while reading

    r = httpx.post(f"{server.url}/v1/completions", content=chunks())
    assert r.status_code == 413


@pytest.fixture(scope="module")
def keyed(chat_llama_dir: Path) -> Iterator[ServerHandle]:
    h = start_server(make_engine(chat_llama_dir, num_blocks=64), served_model_name="tiny", api_key="s3cret",
                     max_pending=1)
    yield h
    h.stop()


def test_api_key(keyed: ServerHandle) -> None:
    url = keyed.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = httpx.post(f"{url}/v1/completions", content=body(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(f"{url}/reset_prefix_cache", headers=headers).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
    good = {"Authorization": "Bearer s3cret"}
    assert httpx.post(f"{url}/v1/completions", content=body(), headers=good).status_code == 200
    assert httpx.post(f"{url}/reset_prefix_cache", headers=good).json() == {"reset": True}
    assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_an_api_key_beyond_ascii_is_matched_as_the_utf8_clients_send() -> None:
    from starlette.requests import Request

    def sent(raw: bytes) -> Request:
        return Request({"type": "http", "headers": [(b"authorization", raw)]})

    check_api_key(sent("Bearer sékret".encode()), "sékret")
    with pytest.raises(APIError):
        check_api_key(sent("Bearer sékret".encode("latin-1")), "sékret")


def test_overload_is_503_and_recovers(keyed: ServerHandle) -> None:
    good = {"Authorization": "Bearer s3cret"}
    gate = threading.Event()
    parked = keyed.engine.call_soon(lambda e: gate.wait(30))  # hold the engine thread between steps
    first: list[httpx.Response] = []
    t = threading.Thread(target=lambda: first.append(
        httpx.post(f"{keyed.url}/v1/completions", content=body(), headers=good, timeout=30)))
    t.start()
    deadline = time.monotonic() + 10
    while keyed.engine.num_pending < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = httpx.post(f"{keyed.url}/v1/completions", content=body(), headers=good)  # limit is 1 in flight
    assert r.status_code == 503 and "overloaded" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1"
    gate.set()
    parked.result(10)
    t.join(30)
    assert first[0].status_code == 200
    assert keyed.engine.num_pending == 0
    assert httpx.post(f"{keyed.url}/v1/completions", content=body(), headers=good).status_code == 200


def test_reset_refused_while_blocks_are_held(keyed: ServerHandle) -> None:
    good = {"Authorization": "Bearer s3cret"}
    parked, gate = threading.Event(), threading.Event()

    def hold(report: StepReport) -> None:  # park the engine right after a step that leaves a request running
        if report.num_running and not gate.is_set():
            parked.set()
            gate.wait(30)

    keyed.engine.add_listener(hold)
    long = json.dumps({**OK, "max_tokens": 50, "stream": True, "ignore_eos": True}).encode()
    got: list[httpx.Response] = []
    try:
        with httpx.stream("POST", f"{keyed.url}/v1/completions", content=long, headers=good) as first:
            assert parked.wait(10)
            t = threading.Thread(target=lambda: got.append(httpx.post(f"{keyed.url}/reset_prefix_cache",
                                                                      headers=good)))
            t.start()
            deadline = time.monotonic() + 10
            while keyed.engine.num_queued == 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # the reset is queued: it runs before the next step, while blocks are held
            gate.set()
            t.join(30)
            assert len(list(first.iter_lines())) > 0
    finally:
        gate.set()
        keyed.engine.remove_listener(hold)
    assert got[0].status_code == 409 and "hold blocks" in got[0].json()["error"]["message"]


def test_a_failed_step_fails_its_requests_and_the_server_serves_on(chat_llama_dir: Path) -> None:
    h = start_server(make_engine(chat_llama_dir, num_blocks=32), served_model_name="tiny")
    try:
        eng = h.engine.engine
        want = httpx.post(f"{h.url}/v1/completions", content=body(), timeout=30).json()["choices"][0]["text"]
        fail_first_step(eng)
        r = httpx.post(f"{h.url}/v1/completions", content=body(prompt="other words"), timeout=30)
        assert r.status_code == 503 and "kernel exploded" in r.json()["error"]["message"], r.text
        assert "retry" in r.json()["error"]["message"]
        assert httpx.get(f"{h.url}/health").status_code == 200
        again = httpx.post(f"{h.url}/v1/completions", content=body(), timeout=30)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == want
        # The cache was reset by the failure: the repeated prompt was computed again, not hit.
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert h.engine.call_soon(lambda e: e.kv.usage).result(10) == 0.0
    finally:
        h.stop()


def test_an_engine_whose_steps_keep_failing_stops(chat_llama_dir: Path) -> None:
    h = start_server(make_engine(chat_llama_dir, num_blocks=32), served_model_name="tiny")
    try:
        def broken_step() -> list:
            raise RuntimeError("kernel exploded")

        h.engine.engine.step = broken_step  # type: ignore[method-assign]
        for _ in range(h.engine.MAX_FAILED_STEPS):
            r = httpx.post(f"{h.url}/v1/completions", content=body(), timeout=10)
            assert r.status_code == 503 and "kernel exploded" in r.json()["error"]["message"]
        assert httpx.get(f"{h.url}/health").status_code == 503
        assert httpx.post(f"{h.url}/v1/completions", content=body()).status_code == 503
        # Every route that asks the engine something: a 503 body, not a 500 with the connection dropped.
        with httpx.Client() as client:  # (one connection: it must survive every answer)
            for method, path in (("GET", "/v1/pins"), ("DELETE", "/v1/pins/p1"), ("POST", "/v1/pins"),
                                 ("POST", "/reset_prefix_cache")):
                r = client.request(method, f"{h.url}{path}", json={"prompt": "hello"})
                assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", (path, r.text)
    finally:
        h.stop()


def test_a_request_tokenized_while_the_engine_stops_is_refused_not_left_waiting(chat_llama_dir: Path) -> None:
    engine = make_engine(chat_llama_dir, num_blocks=32)
    ae = AsyncEngine(engine, max_pending=1)
    ae.start()
    make = engine.make_request

    def stop_meanwhile(*a: object, **kw: object) -> object:
        ae.shutdown()  # the engine thread stops, its inbox read for the last time, while this prompt is tokenized
        return make(*a, **kw)

    engine.make_request = stop_meanwhile  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError, match="not running"):
        asyncio.run(asyncio.wait_for(ae.add_request("hello", SamplingParams.greedy(4), request_id="r"), 10))
    assert ae.num_pending == 0 and ae.num_queued == 0
    with pytest.raises(EngineDeadError):
        ae.call_soon(lambda e: e.kv.usage)


def test_a_request_that_cannot_be_queued_fails_alone(chat_llama_dir: Path) -> None:
    engine = make_engine(chat_llama_dir, num_blocks=32)
    ae = AsyncEngine(engine, max_pending=2)
    ae.start()
    enqueue = engine.enqueue

    def broken_once(req: object) -> None:
        engine.enqueue = enqueue  # type: ignore[method-assign]
        raise RuntimeError("a bug in queueing")

    engine.enqueue = broken_once  # type: ignore[method-assign]

    async def run() -> list[int]:
        first = await ae.add_request("hello", SamplingParams.greedy(4), request_id="a")
        with pytest.raises(EngineStepError, match="could not be queued"):
            async for _ in first:
                pass
        second = await ae.add_request("hello", SamplingParams.greedy(4), request_id="b")
        return [o async for o in second][-1].outputs[0].token_ids

    try:
        assert len(asyncio.run(asyncio.wait_for(run(), 30))) == 4  # the engine serves on
        assert ae.error is None and ae.num_pending == 0
    finally:
        ae.shutdown()


def test_shutdown_with_a_request_in_flight_frees_it(chat_llama_dir: Path) -> None:
    """Its stream fails, and the engine drops it: no blocks held, nothing pending, and an engine started again
    serves a new request rather than finishing the old one for nobody."""
    engine = make_engine(chat_llama_dir, num_blocks=32)
    free = engine.kv.get_num_free_blocks()
    ae = AsyncEngine(engine, max_pending=1)
    ae.start()

    async def run() -> None:
        stream = await ae.add_request("hello there", SamplingParams.greedy(200, ignore_eos=True), request_id="a")
        await anext(stream)
        await asyncio.to_thread(ae.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        assert not engine.has_unfinished_requests() and engine.kv.get_num_free_blocks() == free
        assert ae.num_pending == 0
        ae.start()
        out = [o async for o in await ae.add_request("hello", SamplingParams.greedy(2), request_id="b")]
        assert out[-1].finished and len(out[-1].token_ids) == 2
        ae.shutdown()

    asyncio.run(run())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize(("extra", "sequences"), [({}, 1), ({"prompt": ["hi there", "hello"], "n": 2}, 4)])
def test_a_client_leaving_a_non_streaming_request_aborts_it_without_a_traceback(server: ServerHandle, extra: dict,
                                                                                sequences: int) -> None:
    """(A batch of prompts with n > 1: every sequence of every prompt is aborted.)"""
    errors = _Records()
    logging.getLogger("uvicorn.error").addHandler(errors)
    generated = metric(server.url, "kvpool:generation_tokens_total")
    aborted = metric(server.url, "kvpool:request_success_total", finished_reason="abort")
    try:
        leave_early(f"{server.url}/v1/completions", {**OK, "max_tokens": 480, "ignore_eos": True, **extra}, [server])
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
    assert metric(server.url, "kvpool:generation_tokens_total") - generated < 480  # stopped early
    assert metric(server.url, "kvpool:request_success_total", finished_reason="abort") == aborted + sequences
    assert not [m for m in errors.messages if "Exception in ASGI application" in m]
    assert server.engine.call_soon(lambda e: e.kv.usage).result(10) == 0.0


def test_a_client_leaving_mid_upload_is_no_server_error(server: ServerHandle) -> None:
    """A body cut off before its Content-Length: the client left before anything started (a 499 nobody
    reads, no traceback), and the server serves on."""
    import socket
    import urllib.parse

    errors = _Records()
    logging.getLogger("uvicorn.error").addHandler(errors)
    u = urllib.parse.urlsplit(server.url)
    try:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/pins"):
            with socket.create_connection((u.hostname, u.port), timeout=5) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          "Content-Length: 50000\r\n\r\n".encode() + b'{"prompt": "' + b"a" * 1000)
                time.sleep(0.2)
        time.sleep(0.5)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
    assert not [m for m in errors.messages if "Exception in ASGI application" in m], errors.messages
    assert httpx.post(f"{server.url}/v1/completions", json=OK).status_code == 200


def test_a_wrong_method_names_the_allowed_ones_and_health_takes_head(server: ServerHandle) -> None:
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405
    assert httpx.head(f"{server.url}/health").status_code == 200


def test_a_batch_larger_than_the_server_holds_is_a_400_not_a_503(chat_llama_dir: Path) -> None:
    """A 503 says "retry later", which a batch over --max-pending would do forever."""
    h = start_server(make_engine(chat_llama_dir), served_model_name="tiny", max_pending=2)
    try:
        r = httpx.post(f"{h.url}/v1/completions", json={**OK, "prompt": ["a", "b", "c"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "a batch of 3 prompts is more than this server holds in flight (--max-pending 2)" in r.text
        assert httpx.post(f"{h.url}/v1/completions", json={**OK, "prompt": ["a", "b"]}).status_code == 200
    finally:
        h.stop()


def test_structured_requests_are_made_apart_from_plain_ones(chat_llama_dir: Path) -> None:
    """A structured output's constraint is compiled when its request is made (seconds for a pathological schema,
    which llguidance cannot cancel): on threads of their own, so a burst of them never holds the threads that
    tokenize plain requests. While one is held mid-compile, a plain request is made and answered."""
    import threading

    from kvpool.engine.sampling_params import StructuredOutputsParams

    engine = make_engine(chat_llama_dir, num_blocks=32)
    ae = AsyncEngine(engine, max_pending=9)
    ae.start()
    make = engine.make_request
    held, release, threads = threading.Event(), threading.Event(), {}

    def slow_compile(prompt: object, params: SamplingParams, **kw: object) -> object:
        threads[kw["request_id"]] = threading.current_thread().name
        if params.structured_outputs is not None:
            held.set()
            release.wait(30)
        return make(prompt, params, **kw)  # type: ignore[arg-type]

    engine.make_request = slow_compile  # type: ignore[method-assign]

    async def run() -> str:
        so = SamplingParams.greedy(2, structured_outputs=StructuredOutputsParams(choice=["yes"]))
        slow = [asyncio.create_task(ae.add_request("hello", so, request_id=f"s{i}")) for i in range(8)]
        await asyncio.to_thread(held.wait, 10)
        plain = await asyncio.wait_for(ae.add_request("hello", SamplingParams.greedy(2), request_id="p"), 10)
        async for out in plain:
            done = out
        release.set()
        for t in slow:
            async for _ in await t:
                pass
        return done.outputs[0].finish_reason

    async def again() -> None:
        so = SamplingParams.greedy(2, structured_outputs=StructuredOutputsParams(choice=["yes"]))
        # Compiled now: made with the plain requests, not queued behind compiles.
        async for _ in await ae.add_request("hello", so, request_id="again"):
            pass
        # Requests being made hold their places: a burst past max_pending is refused, not queued for a compile.
        release.clear()
        new = SamplingParams.greedy(2, structured_outputs=StructuredOutputsParams(choice=["no"]))
        burst = [asyncio.create_task(ae.add_request("hello", new, request_id=f"b{i}")) for i in range(10)]
        await asyncio.sleep(0.5)
        release.set()
        outcome = await asyncio.gather(*burst, return_exceptions=True)
        assert sum(isinstance(o, EngineOverloadedError) for o in outcome) == 1  # (9 places)
        for o in outcome:
            if not isinstance(o, BaseException):
                async for _ in o:
                    pass

    try:
        assert asyncio.run(run()) == "length"
        assert threads["p"] != threads["s0"] and threads["s0"].startswith("kvpool-grammar")
        asyncio.run(again())
        assert not threads["again"].startswith("kvpool-grammar") and ae.num_pending == 0
        # Stopped and started again: structured requests are made again (their threads made anew).
        ae.shutdown()
        ae.start()
        so = SamplingParams.greedy(2, structured_outputs=StructuredOutputsParams(regex="[0-9]"))

        async def restarted() -> str:
            async for out in await ae.add_request("hello", so, request_id="r"):
                last = out
            return last.outputs[0].text

        assert asyncio.run(restarted()).isdigit()
    finally:
        release.set()
        ae.shutdown()


def test_a_duplicate_id_refused_at_queueing_leaves_the_running_requests_timing(chat_llama_dir: Path) -> None:
    """Two requests with one id can both be made (the id is checked before a slow part, a constraint's compile)
    and the second refused only when queued: the first's per-step timing must stay its own (its prompt once
    counted its prefill twice)."""
    import threading

    engine = make_engine(chat_llama_dir, num_blocks=32)
    ae = AsyncEngine(engine)
    prompts: list[int] = []
    ae.add_listener(lambda r: prompts.append(r.prompt_tokens) if r.prompt_tokens else None)
    make, running = engine.make_request, threading.Event()

    def slow(*a: object, **kw: object) -> object:
        r = make(*a, **kw)  # type: ignore[arg-type]
        if kw.get("cache_salt") == "slow":
            running.wait(10)  # (made, its id checked; queued once the other one runs)
        return r

    engine.make_request = slow  # type: ignore[method-assign]

    async def run() -> None:
        sp = SamplingParams.greedy(400, ignore_eos=True)
        late = asyncio.create_task(ae.add_request("Hello there", sp, request_id="a", cache_salt="slow"))
        await asyncio.sleep(0.2)
        first = await ae.add_request("Hello there", sp, request_id="a")
        async for _ in first:
            running.set()
            refused = await late  # (refused when queued: on its stream)
            with pytest.raises(ValueError, match="request_id: 'a' is already in use"):
                async for _ in refused:
                    pass
            break
        async for _ in first:
            pass

    ae.start()
    try:
        asyncio.run(run())
        assert len(prompts) == 1 and ae.num_pending == 0
    finally:
        running.set()
        ae.shutdown()
