"""The server through the official `openai` client: completions and chat, streaming or not, exactly the
tokens the offline engine produces, cached-token counts, cache salts, and 32 concurrent streams of
which some hang up early."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import BLOCK, make_engine, metric

from kvpool.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvpool.server.serve import ServerHandle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(chat_llama_dir: Path):  # the same model and settings, no server: the reference
    return make_engine(chat_llama_dir)


def offline_text(engine, prompt: str | list[int], max_tokens: int, **kw: object) -> tuple[str, list[int]]:
    engine.add_request(prompt, SamplingParams.greedy(max_tokens, **kw))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.text, out.token_ids
    raise AssertionError("no output")


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_matches_offline_engine_streaming_or_not(client: openai.OpenAI, offline) -> None:
    prompt = "The quick brown fox jumps over the lazy dog because"
    want, want_ids = offline_text(offline, prompt, 12)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(offline.encode(prompt))
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # Token ids as the prompt (what benchmarks send) give the same continuation.
    ids = offline.encode(prompt)
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0).choices[0].text == want
    assert want_ids  # the offline reference really generated


def test_stop_reason_and_the_usage_field_as_vllm_and_openai_send_them(server: ServerHandle, offline) -> None:
    prompt = "The quick brown fox jumps over the lazy dog because"
    _, ids = offline_text(offline, prompt, 12)
    stop = ids[3]  # the 4th token ends it
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop]}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == stop
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "stop_token_ids": []}, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["stop_reason"] is None
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    # With include_usage, every chunk carries "usage": null but the last, which carries the counts.
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    finals = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert [(f["finish_reason"], f["stop_reason"]) for f in finals] == [("stop", stop)]


def test_chat_matches_offline_engine_streaming_or_not(client: openai.OpenAI, offline) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    want, _ = offline_text(offline, offline.apply_chat_template(messages), 10)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_cached_tokens_rise_on_a_repeated_prefix(client: openai.OpenAI, server: ServerHandle) -> None:
    doc = list(range(1000, 1000 + 5 * BLOCK + 3))  # 83 tokens: 5 full blocks
    hits0 = metric(server.url, "kvpool:prefix_cache_hits_total")
    first = client.completions.create(model="tiny", prompt=doc, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=[*doc, 7, 8], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK
    assert metric(server.url, "kvpool:prefix_cache_hits_total") - hits0 == 5 * BLOCK


def test_cache_salt_isolates_tenants(client: openai.OpenAI) -> None:
    doc = list(range(3000, 3000 + 3 * BLOCK + 1))

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else None
        r = client.completions.create(model="tiny", prompt=doc, max_tokens=1, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 3 * BLOCK
    assert cached("tenant-b") == 0  # same tokens, another tenant: no hit
    assert cached(None) == 0  # unsalted requests do not see salted blocks either
    assert cached(None) == 3 * BLOCK


def test_32_concurrent_streams_with_early_hangups(server: ServerHandle, offline) -> None:
    prompts = [[2000 + i, *range(500, 500 + 20 + i)] for i in range(32)]
    want = [offline_text(offline, p, 16)[0] for p in prompts]
    hangup = set(range(0, 32, 4))  # these ask for 400 tokens: only an abort frees their blocks before the end

    async def one(aclient: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await aclient.completions.create(model="tiny", prompt=prompts[i], temperature=0, stream=True,
                                                  max_tokens=400 if i in hangup else 16)
        text, n = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text
            n += 1
            if i in hangup and n == 2:
                await stream.close()
                return None
        return text

    async def run() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    tokens0 = metric(server.url, "kvpool:generation_tokens_total")
    got = asyncio.run(run())
    for i in range(32):
        if i not in hangup:
            assert got[i] == want[i], i
    # Hung-up requests were aborted, and every block returned: had they run on, they would have made
    # 8 x 400 tokens.
    assert asyncio.run(_wait_idle(server, timeout=30.0))
    assert metric(server.url, "kvpool:generation_tokens_total") - tokens0 < 24 * 16 + 8 * 200
    assert metric(server.url, "kvpool:kv_cache_usage_perc") == 0.0
    assert metric(server.url, "kvpool:num_requests_running") == 0.0
    server.engine.call_soon(lambda e: e.kv.check_integrity()).result(10)
    assert server.engine.call_soon(lambda e: e.kv.usage).result(10) == 0.0
    assert server.engine.num_pending == 0


async def _wait_idle(server: ServerHandle, timeout: float = 20.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if server.engine.num_pending == 0 and metric(server.url, "kvpool:kv_cache_usage_perc") == 0.0:
            return True
        await asyncio.sleep(0.05)
    return False


def test_metrics_count_requests_and_latencies(server: ServerHandle, client: openai.OpenAI) -> None:
    before = {n: metric(server.url, n) for n in ("kvpool:time_to_first_token_seconds_count",
                                                 "kvpool:generation_tokens_total", "kvpool:request_success_total",
                                                 "kvpool:prefix_cache_queries_total")}
    client.completions.create(model="tiny", prompt=list(range(100, 140)), max_tokens=5, temperature=0)
    client.completions.create(model="tiny", prompt=list(range(200, 230)), max_tokens=3, temperature=0)
    delta = {n: metric(server.url, n) - v for n, v in before.items()}
    assert delta == {"kvpool:time_to_first_token_seconds_count": 2, "kvpool:generation_tokens_total": 8,
                     "kvpool:request_success_total": 2, "kvpool:prefix_cache_queries_total": 70}
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_n_choices_streaming_or_not(client: openai.OpenAI, offline) -> None:
    """n > 1: choices by index, each the answer a request of its own gives (greedy: the same one; seeded:
    choice i is the request with seed + i), streamed interleaved; usage counts the prompt once and every
    choice's tokens."""
    prompt = "The quick brown fox jumps over the lazy dog because"
    want, _ = offline_text(offline, prompt, 6)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, n=3)
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(i, want, "length") for i in range(3)]
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == len(offline.encode(prompt))
    seeded = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=3, n=2)
    alone = [client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=3 + i
                                       ).choices[0].text for i in range(2)]
    assert [c.text for c in seeded.choices] == alone and alone[0] != alone[1]
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=3, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == alone[i]
        assert [c.finish_reason for c in mine][-1] == "length" and all(c.finish_reason is None for c in mine[:-1])
    assert chunks[-1].usage.completion_tokens == 12
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, n=2,
                                                   stream=True))
    for i in range(2):
        mine = [c.choices[0] for c in streamed if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == chat.choices[i].message.content
        assert mine[-1].finish_reason == chat.choices[i].finish_reason


def test_a_batch_of_prompts_streaming_or_not(client: openai.OpenAI, offline) -> None:
    """A list of prompts: each a request of its own, choices numbered prompt by prompt (prompt i's choice j
    is i * n + j), each the answer the prompt gets alone; usage sums them."""
    prompts = ["The quick brown fox", "Once upon a time there", "The quick brown fox jumps"]
    want = [offline_text(offline, p, 5)[0] for p in prompts]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(i, want[i // 2]) for i in range(6)]
    assert r.usage.prompt_tokens == sum(len(offline.encode(p)) for p in prompts) and r.usage.completion_tokens == 30
    ids = [offline.encode(p) for p in prompts]
    assert [c.text for c in client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0).choices
            ] == want
    chunks = list(client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == want[i] and mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 15


def offline_logprobs(engine, prompt: list[int], max_tokens: int, k: int):
    engine.add_request(prompt, SamplingParams.greedy(max_tokens, logprobs=k))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs[0]
    raise AssertionError("no output")


def test_logprobs_in_both_shapes_streaming_or_not(client: openai.OpenAI, offline) -> None:
    """Chat's `logprobs`/`top_logprobs` and a completion's `logprobs` count: the engine's numbers, each token
    as its own decoded text, streamed token by token with the chunks that bring them."""
    prompt = "The quick brown fox jumps over the lazy dog because"
    ids = offline.encode(prompt)
    want = offline_logprobs(offline, ids, 6, 3)
    texts = offline.token_texts(want.token_ids)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == texts and lp.token_logprobs == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(6)]
    # (the sampled token first, then the top 3: greedy, the sampled one is the first of them)
    assert [list(d) for d in lp.top_logprobs] == [offline.token_texts([i for i, _ in t.top]) for t in want.logprobs]
    sampled = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=1, logprobs=0)
    slp = sampled.choices[0].logprobs
    assert [list(d.items()) for d in slp.top_logprobs] == [[(t, v)] for t, v in zip(slp.tokens, slp.token_logprobs,
                                                                                        strict=True)]
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                              stream=True))
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs is not None]
    assert [t for p in parts for t in p.tokens] == texts and [o for p in parts for o in p.text_offset] == lp.text_offset

    messages = [{"role": "user", "content": prompt}]
    chat_ids = offline.apply_chat_template(messages)
    want = offline_logprobs(offline, chat_ids, 5, 2)
    c = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert [t.token for t in content] == offline.token_texts(want.token_ids)
    assert [t.logprob for t in content] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
    assert [t.bytes for t in content] == [list(t.token.encode()) for t in content]
    assert [x.logprob for t in content for x in t.top_logprobs] == pytest.approx(
        [v for t in want.logprobs for _, v in t.top], abs=1e-5)
    assert [len(t.top_logprobs) for t in content] == [2] * 5
    streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                   logprobs=True, stream=True))
    flat = [t for ch in streamed if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.top_logprobs) for t in flat] == [(t.token, []) for t in content]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == c.choices[0].message.content


def offline_prompt_logprobs(engine, prompt: list[int], k: int):
    engine.add_request(prompt, SamplingParams.greedy(1, prompt_logprobs=k))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("no output")


def test_echo_scores_a_text_as_lm_eval_asks(server: ServerHandle, offline) -> None:
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1, or 0): the prompt's text and its tokens'
    log-probabilities before the answer's, the first token's null; the engine's numbers."""
    prompt = "The quick brown fox jumps over the lazy dog because " * 4  # (over two blocks of 16)
    ids = offline.encode(prompt)
    want = offline_prompt_logprobs(offline, ids, 1)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    c = r["choices"][0]
    assert c["text"] == prompt + offline.decode(want.token_ids) and "prompt_logprobs" not in c
    lp = c["logprobs"]
    texts = offline.token_texts(ids + want.token_ids)
    assert lp["tokens"] == texts
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx([t.logprob for t in want.prompt_logprobs[1:]], abs=1e-5)
    assert [list(d) for d in lp["top_logprobs"][1:len(ids)]] == [
        offline.token_texts([t.token_id, *(i for i, _ in t.top)]) if t.top[0][0] != t.token_id
        else offline.token_texts([t.token_id]) for t in want.prompt_logprobs[1:]]
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert r["usage"]["completion_tokens"] == 1 and r["usage"]["prompt_tokens"] == len(ids)
    # max_tokens 0: the prompt alone, scored.
    read = metric(server.url, "kvpool:prompt_rows_hits_total")
    r0 = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 0}, timeout=60).json()
    c0 = r0["choices"][0]
    assert c0["text"] == prompt and c0["finish_reason"] == "length" and r0["usage"]["completion_tokens"] == 0
    # (scored before: its blocks' rows are cached, so the second scoring hits its full blocks)
    assert r0["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // BLOCK * BLOCK > 0
    assert metric(server.url, "kvpool:prompt_rows_hits_total") - read == (len(ids) - 1) // BLOCK * BLOCK
    assert metric(server.url, "kvpool:prompt_rows_cache_bytes") > 0
    assert c0["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)]
    assert c0["logprobs"]["tokens"] == lp["tokens"][:len(ids)]
    # Streamed: the same text and tokens, the prompt's in the first chunk.
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "max_tokens": 4, "stream": True},
                      timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith(prompt)
    full = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 4}, timeout=60).json()["choices"][0]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == full["text"]
    assert [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]] == full["logprobs"]["tokens"]
    # Echo without logprobs, a batch: each prompt before its own choice.
    rb = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [ids, ids[:4]], "echo": True,
                                                          "max_tokens": 2, "temperature": 0}, timeout=60).json()
    assert [ch["text"] for ch in rb["choices"]] == [offline.decode(p) + offline_text(offline, p, 2)[0]
                                                    for p in (ids, ids[:4])]
    assert rb["choices"][0]["logprobs"] is None and rb["usage"]["completion_tokens"] == 4
    # truncate_prompt_tokens: the prompt the engine ran is the one echoed.
    rt = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 0, "truncate_prompt_tokens": 3},
                    timeout=60).json()
    assert rt["choices"][0]["text"] == offline.decode(ids[-3:]) and rt["usage"]["prompt_tokens"] == 3
    assert rt["choices"][0]["logprobs"]["tokens"] == offline.token_texts(ids[-3:])
    bad = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": False, "max_tokens": 0}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert "0 only with echo" in bad.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 0, "min_tokens": 2}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"


def test_prompt_logprobs_as_vllm_returns_them(server: ServerHandle, offline) -> None:
    """vLLM's `prompt_logprobs`: per prompt token, null first, then {id: {logprob, rank, decoded_token}} with the
    prompt's token and the top k; in the choice on /v1/completions, at the top on chat, streamed in the first
    chunk."""
    prompt = "The quick brown fox jumps over the lazy dog because"
    ids = offline.encode(prompt)
    want = offline_prompt_logprobs(offline, ids, 2)

    def expected(lps) -> list:
        out = [None]
        for t in lps[1:]:
            e = {str(t.token_id): {"logprob": pytest.approx(t.logprob, abs=1e-5), "rank": t.rank,
                                   "decoded_token": offline.token_texts([t.token_id])[0]}}
            for r, (i, v) in enumerate(t.top, start=1):
                e.setdefault(str(i), {"logprob": pytest.approx(v, abs=1e-5), "rank": r,
                                      "decoded_token": offline.token_texts([i])[0]})
            out.append(e)
        return out

    body = {"model": "tiny", "prompt": ids, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    c = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert c["prompt_logprobs"] == expected(want.prompt_logprobs) and c["logprobs"] is None
    assert any(len(e) == 3 for e in c["prompt_logprobs"][1:])  # (a prompt token outside its top 2)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["prompt_logprobs"] == c["prompt_logprobs"]
    assert all("prompt_logprobs" not in ch["choices"][0] for ch in chunks[1:])
    # n = 2, streamed with echo and logprobs: each choice opens with the prompt's log-probabilities (child 0
    # computes them), its tokens are the prompt's then its answer's, and each carries prompt_logprobs once.
    two = {**body, "n": 2, "temperature": 1.0, "seed": 3, "echo": True, "logprobs": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=two, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    whole = httpx.post(f"{server.url}/v1/completions", json={**two, "stream": False}, timeout=60).json()["choices"]
    for i in range(2):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i]
        assert "prompt_logprobs" in mine[0]
        assert mine[0]["prompt_logprobs"] == c["prompt_logprobs"] and sum("prompt_logprobs" in m for m in mine) == 1
        tokens = [t for m in mine if m["logprobs"] for t in m["logprobs"]["tokens"]]
        assert tokens == whole[i]["logprobs"]["tokens"] and len(tokens) == len(ids) + 3
        assert "".join(m["text"] for m in mine) == whole[i]["text"]

    messages = [{"role": "user", "content": prompt}]
    chat_want = offline_prompt_logprobs(offline, offline.apply_chat_template(messages), 1)
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2,
                                                               "prompt_logprobs": 1}, timeout=60).json()
    assert r["prompt_logprobs"] == expected(chat_want.prompt_logprobs)
    for bad in (-1, 21, "2", True):
        e = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt_logprobs": bad}, timeout=60)
        assert e.status_code == 400 and e.json()["error"]["param"] == "prompt_logprobs", bad


def test_return_token_ids_as_vllm_returns_them(server: ServerHandle, offline) -> None:
    """vLLM's return_token_ids: the prompt's ids and each choice's (completions: in the choice; chat: the
    prompt's at the top), streamed with the chunks that bring them, the prompt's in the first."""
    prompt = "The quick brown fox jumps over the lazy dog because"
    ids = offline.encode(prompt)
    _, want = offline_text(offline, ids, 5)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    c = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert c["prompt_token_ids"] == ids and c["token_ids"] == want and c["text"] == offline.decode(want)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in ch for ch in chunks[1:])
    assert [t for ch in chunks for t in ch["token_ids"]] == want
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": False}, timeout=60).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]

    messages = [{"role": "user", "content": prompt}]
    chat_ids = offline.apply_chat_template(messages)
    _, chat_want = offline_text(offline, chat_ids, 4)
    chat = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert r["prompt_token_ids"] == chat_ids and r["choices"][0]["token_ids"] == chat_want
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == chat_ids  # (the first chunk of all, as vLLM's: the role's)
    assert [e.get("prompt_token_ids") for e in events if "prompt_token_ids" in e] == [chat_ids]
    assert [t for e in events for t in e["choices"][0].get("token_ids", [])] == chat_want
    # Truncated: the ids and every chunk's usage are the truncated prompt's, the role chunk's too.
    cut = {**chat, "stream": True, "truncate_prompt_tokens": 5,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=cut, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == chat_ids[-5:]
    assert {e["usage"]["prompt_tokens"] for e in events} == {5}
    events = [e for e in events if e["choices"]]  # (less the last, usage-only chunk)
    _, cut_want = offline_text(offline, chat_ids[-5:], 4)
    assert [t for e in events for t in e["choices"][0].get("token_ids", [])] == cut_want


def test_bad_words_and_special_tokens_text_as_the_engine_gives_them(server: ServerHandle, offline) -> None:
    """vLLM's bad_words and skip_special_tokens / spaces_between_special_tokens pass through to the engine:
    the same tokens and text as offline, streamed or not."""
    prompt = "The quick brown fox jumps over the lazy dog because"
    start, end = offline.encode("<|im_start|><|im_end|>", add_special_tokens=False)
    # Both special tokens pushed up, the likelier banned (a bad word can be a special token's text).
    sampling = {"bad_words": ["<|im_start|>"], "skip_special_tokens": False, "spaces_between_special_tokens": False,
                "ignore_eos": True}
    text, want = offline_text(offline, prompt, 3, logit_bias={start: 100, end: 50}, **sampling)
    assert want == [end] * 3 and text == "<|im_end|>" * 3
    sampling["logit_bias"] = {str(start): 100, str(end): 50}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "return_token_ids": True,
            **sampling}
    c = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert c["token_ids"] == want and c["text"] == text
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(ch["text"] for ch in chunks) == text


def test_structured_outputs_from_every_field_that_asks_for_one(server: ServerHandle, offline) -> None:
    """OpenAI's response_format (json_schema, json_object), vLLM's structured_outputs and its guided_* fields:
    the same tokens as the engine's StructuredOutputsParams offline, streamed or not."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    chat_ids = offline.apply_chat_template(messages)
    text, _ = offline_text(offline, chat_ids, 20, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    assert json.loads(text) in ({"ok": True}, {"ok": False})
    chat = {"model": "tiny", "messages": messages, "max_tokens": 20, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    flexible, _ = offline_text(offline, chat_ids, 20, structured_outputs=StructuredOutputsParams(json=schema))
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert r["choices"][0]["message"]["content"] == flexible
    via = {**chat, "response_format": None,
           "structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=via, timeout=60).json()
    assert r["choices"][0]["message"]["content"] == text
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**via, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == text
    prompt = "The answer is"
    for field, value, so in [("guided_choice", ["yes", "no"], StructuredOutputsParams(choice=["yes", "no"])),
                             ("guided_regex", "[0-9]{3}", StructuredOutputsParams(regex="[0-9]{3}")),
                             ("guided_json", schema, StructuredOutputsParams(json=schema))]:
        want_text, want_ids = offline_text(offline, prompt, 12, structured_outputs=so)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, field: value,
                "return_token_ids": True}
        c = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert (c["text"], c["token_ids"]) == (want_text, want_ids), field
    # response_format text (with the other fields a client may send null): no constraint.
    free_text, _ = offline_text(offline, prompt, 12)
    free = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "response_format": {"type": "text", "json_schema": None}}
    assert httpx.post(f"{server.url}/v1/completions", json=free, timeout=60).json()["choices"][0]["text"] == free_text
    obj = {"model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0,
           "response_format": {"type": "json_object"}}
    want_text, _ = offline_text(offline, prompt, 30, structured_outputs=StructuredOutputsParams(json_object=True))
    assert httpx.post(f"{server.url}/v1/completions", json=obj, timeout=60).json()["choices"][0]["text"] == want_text


def test_text_parts_are_a_line_apart_as_in_vllm(client: openai.OpenAI, server: ServerHandle) -> None:
    """Content given as several text parts is the parts joined by a line break (vLLM's prompt, so its
    cached blocks too), not run together."""
    def ids(content: object) -> list[int]:
        r = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": content}]})
        return r.json()["tokens"]

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert ids(parts) == ids("Hello\nworld") != ids("Helloworld")
    one = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=4,
                                         temperature=0)
    joined = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello\nworld"}],
                                            max_tokens=4, temperature=0)
    assert one.choices[0].message.content == joined.choices[0].message.content


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: openai.OpenAI, offline) -> None:
    chunks = list(client.completions.create(model="tiny", prompt="Count with me: one two", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    with_text = [c for c in chunks if c.choices]
    counts = [c.usage.completion_tokens for c in with_text]
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0 for c in with_text)
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].usage.completion_tokens == 6
    plain = list(client.completions.create(model="tiny", prompt="Count with me: one two", max_tokens=6, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices) and plain[-1].usage.completion_tokens == 6
    # A batch with n = 2: each chunk its own prompt's tokens and its own choice's so far (vLLM's).
    prompts = ["Count with me: one two", "Hi"]
    lengths = [len(offline.encode(p)) for p in prompts]
    batch = list(client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0, n=2,
                                           stream=True, stream_options={"include_usage": True,
                                                                        "continuous_usage_stats": True},
                                           extra_body={"ignore_eos": True}))
    for i in range(4):
        mine = [c for c in batch if c.choices and c.choices[0].index == i]
        assert all(c.usage.prompt_tokens == lengths[i // 2] for c in mine)
        assert [c.usage.completion_tokens for c in mine] == sorted(c.usage.completion_tokens for c in mine)
        assert mine[-1].usage.completion_tokens == 4
    assert batch[-1].usage.prompt_tokens == sum(lengths) and batch[-1].usage.completion_tokens == 16


def test_each_choice_counts_its_own_inter_token_latencies(client: openai.OpenAI, server: ServerHandle) -> None:
    """n > 1: each choice's gaps between its tokens (3 choices x 4 gaps), and the prompt once."""
    def counts() -> tuple[float, float]:
        return (metric(server.url, "kvpool:inter_token_latency_seconds_count"),
                metric(server.url, "kvpool:prompt_tokens_total"))

    itl, prompt = counts()
    r = client.completions.create(model="tiny", prompt="One two three four", max_tokens=5, temperature=0, n=3,
                                  extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 5
    while counts()[0] < itl + 12 and time.monotonic() < deadline:  # (the step's report follows its outputs)
        time.sleep(0.02)
    assert counts() == (itl + 12, prompt + r.usage.prompt_tokens)


def test_penalties_reach_the_engine(client: openai.OpenAI, offline) -> None:
    prompt = "the the the the the the the"
    ids = offline.encode(prompt)
    want = offline_logprobs(offline, ids, 8, 0)  # (greedy, no penalty: the baseline)
    # (repetition below 1 pulls the prompt's tokens up: this random model never repeats on its own)
    kw = dict(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=0.2)
    offline.add_request(ids, SamplingParams.greedy(8, **kw))
    penalized = None
    while offline.has_unfinished_requests():
        for out in offline.step():
            if out.finished:
                penalized = out.token_ids
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                  presence_penalty=0.5, frequency_penalty=0.25, extra_body={"repetition_penalty": 0.2})
    assert offline.encode(r.choices[0].text) == penalized or r.choices[0].text == offline.decode(penalized)
    assert penalized != want.token_ids


def test_min_tokens_holds_back_stop_strings(client: openai.OpenAI, offline) -> None:
    prompt = "The quick brown fox jumps over the lazy dog because"
    want, ids = offline_text(offline, prompt, 8)
    stop = want[:2]
    assert stop.strip()  # (a stop string the answer starts with)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    held = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens >= 3 and held.choices[0].text.startswith(offline.decode(ids[:3]))


def test_a_stop_string_completed_by_the_min_tokens_th_token_does_not_stop(client: openai.OpenAI, offline) -> None:
    """vLLM checks stop strings once the answer is longer than min_tokens: a string the 3rd token completes
    does not end an answer with min_tokens 3 (as a stop token may first be the 4th)."""
    prompt = "The quick brown fox jumps over the lazy dog because"
    _, ids = offline_text(offline, prompt, 8)
    stop = offline.decode(ids[2:3]).strip()
    assert stop and stop not in offline.decode(ids[:2])
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert plain.usage.completion_tokens == 3 and plain.choices[0].finish_reason == "stop"
    held = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens > 3


def test_chat_template_options_as_vllm_takes_them(server: ServerHandle, offline) -> None:
    """add_generation_prompt, continue_final_message (an answer prefilled, continued) and chat_template_kwargs,
    rendered as the offline engine renders them; contradictions and the renderer's own names are a 400."""
    from kvpool.engine.chat_template import ChatOptions

    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
            "add_generation_prompt": False, "continue_final_message": True}
    want = offline.apply_chat_template(msgs, options=ChatOptions(False, True))
    assert offline.decode(want).endswith("The color is")  # (left open: no end-of-turn token after it)
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert r["prompt_token_ids"] == want and r["choices"][0]["token_ids"] == offline_text(offline, want, 4)[1]
    tok = httpx.post(f"{server.url}/tokenize", json={"messages": msgs, "add_generation_prompt": False,
                                                       "continue_final_message": True}).json()
    assert tok["tokens"] == want
    closed = offline.apply_chat_template(msgs, add_generation_prompt=False)
    assert httpx.post(f"{server.url}/tokenize", json={"messages": msgs, "add_generation_prompt": False}
                      ).json()["tokens"] == closed != want
    for extra, param in (({"add_generation_prompt": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs"),  # (the renderers'
                         ({"chat_template_kwargs": {"conversations": 1}}, "chat_template_kwargs"),  # arguments)
                         ({"chat_template_kwargs": {"raise_exception": 1}}, "chat_template_kwargs"),  # (functions
                         ({"chat_template_kwargs": {"range": 1}}, "chat_template_kwargs"),  # templates call)
                         ({"chat_template_kwargs": {"1x": 1}}, "chat_template_kwargs")):
        e = httpx.post(f"{server.url}/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, (extra, e.text)
    # (a template variable reaches the template: a harmless one changes nothing for this template)
    ok = httpx.post(f"{server.url}/v1/chat/completions",
                    json={**body, "chat_template_kwargs": {"enable_thinking": False}}, timeout=60).json()
    assert ok["prompt_token_ids"] == want
    # /tokenize: null options are their defaults; contradictory ones are refused even with a prompt.
    assert httpx.post(f"{server.url}/tokenize", json={"messages": msgs, "add_generation_prompt": None,
                                                       "continue_final_message": None}).status_code == 200
    e = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi", "continue_final_message": True})
    assert e.status_code == 400 and e.json()["error"]["param"] == "continue_final_message"
    # A pin takes the template variables its chats will be sent with.
    assert httpx.post(f"{server.url}/v1/pins", json={"messages": msgs[:1], "ttl": 1,
                                                      "chat_template_kwargs": {"enable_thinking": False}}
                      ).status_code == 200


def test_template_variables_reach_the_template(chat_llama_dir: Path) -> None:
    from kvpool.engine.chat_template import ChatOptions

    eng = make_engine(chat_llama_dir)
    eng.tokenizer.chat_template = ("{% if greeting %}{{ greeting }}{% endif %}"
                                   "{% for m in messages %}{{ m.content }}{% endfor %}")
    msgs = [{"role": "user", "content": "world"}]
    assert eng.decode(eng.apply_chat_template(msgs, options=ChatOptions(template_kwargs={"greeting": "Hello "}))
                      ) == "Hello world"
    assert eng.decode(eng.apply_chat_template(msgs)) == "world"
    # A pin of the chats' first messages, rendered with the variables the chats carry, is their prefix.
    eng.tokenizer.chat_template = ("{% if greeting %}{{ greeting }}{% endif %}"
                                   "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    system = [{"role": "system", "content": "Be brief."}]
    chat = [*system, {"role": "user", "content": "Hi"}]
    kw = {"greeting": "Hello "}
    pinned = eng.chat_prefix(system, kw)
    assert eng.apply_chat_template(chat, options=ChatOptions(template_kwargs=kw))[:len(pinned)] == pinned
    assert eng.decode(pinned).startswith("Hello <system>Be brief.")
    # OpenAI's `developer` role is a system message, and a null content an empty one, offline as on the server.
    assert eng.apply_chat_template([{"role": "developer", "content": None}, *chat[1:]]) == \
        eng.apply_chat_template([{"role": "system", "content": ""}, *chat[1:]])


def test_llm_chat_takes_the_same_options(chat_llama_dir: Path) -> None:
    from kvpool import LLM
    from kvpool.engine.chat_template import ChatOptions

    llm = LLM(str(chat_llama_dir), dtype="float32", num_blocks=64, block_size=BLOCK)
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    out = llm.chat(msgs, SamplingParams.greedy(2), use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt_token_ids == llm.engine.apply_chat_template(msgs, options=ChatOptions(False, True))
    with pytest.raises(ValueError, match="continue_final_message: true leaves"):
        llm.chat(msgs, SamplingParams.greedy(2), use_tqdm=False, continue_final_message=True)
