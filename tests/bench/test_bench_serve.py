"""`kvpool bench serve` against a stub OpenAI-compatible server: counts, timings, hit rate, bounds, datasets."""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvpool.bench.serve import (
    BenchRequest,
    arrival_offsets,
    base_url_of,
    build_requests,
    check_loopback,
    prefix_cache_counters,
    run_benchmark,
    summarize,
)
from kvpool.cli import build_parser, main

BLOCK = 16


@dataclass
class StubState:
    first_delay: float = 0.0
    gap: float = 0.0
    max_prompt_len: int = 10_000
    omit_usage: bool = False
    no_metrics: bool = False
    in_flight: int = 0
    max_in_flight: int = 0
    payloads: list[dict[str, Any]] = field(default_factory=list)
    seen: list[list[int]] = field(default_factory=list)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.queries = Counter("kvpool:prefix_cache_queries", "prompt tokens looked up", registry=self.registry)
        self.hits = Counter("kvpool:prefix_cache_hits", "prompt tokens found cached", registry=self.registry)
        # Counts from "earlier traffic", so that only a delta gives the run's hit rate.
        self.queries.inc(1000)
        self.hits.inc(700)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def make_stub_app(state: StubState) -> FastAPI:
    """A stub of the OpenAI completions contract, only for testing the benchmark client: no model behind it.

    It streams one chunk per requested token (" tok") after `first_delay`, then one every `gap` seconds,
    ends with a usage chunk and [DONE], and counts prefix-cache hits as the longest common prefix with
    any earlier prompt, rounded down to whole blocks of 16 tokens.
    """

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def metrics(_: Request) -> Response:
        if state.no_metrics:
            return Response("not found", status_code=404)
        return Response(generate_latest(state.registry), media_type="text/plain; version=0.0.4")

    async def completions(request: Request) -> Response:
        body = await request.json()
        state.payloads.append(body)
        prompt: list[int] = body["prompt"]
        if len(prompt) > state.max_prompt_len:
            return JSONResponse({"error": {"message": f"This model's maximum context length is {state.max_prompt_len}"
                                                      f" tokens; the prompt has {len(prompt)}",
                                           "type": "BadRequestError", "code": 400}}, status_code=400)
        lcp = max((common_prefix_len(p, prompt) for p in state.seen), default=0)
        hit = lcp // BLOCK * BLOCK
        state.seen.append(prompt)
        state.queries.inc(len(prompt))
        state.hits.inc(hit)
        n = body["max_tokens"]

        async def stream() -> AsyncIterator[str]:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                await asyncio.sleep(state.first_delay)
                for k in range(n):
                    if k:
                        await asyncio.sleep(state.gap)
                    choice = {"index": 0, "text": " tok", "finish_reason": "length" if k == n - 1 else None}
                    chunk = {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if body.get("stream_options", {}).get("include_usage") and not state.omit_usage:
                    usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                             "prompt_tokens_details": {"cached_tokens": hit}}
                    yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    app = FastAPI()
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    return app


@dataclass
class Stub:
    base: str
    holder: dict[str, StubState]

    @property
    def state(self) -> StubState:
        return self.holder["state"]


@pytest.fixture(scope="module")
def stub_server() -> Iterator[Stub]:
    holder = {"state": StubState()}

    # The app reads the current state through the holder, so each test starts from a fresh one.
    class Proxy:
        def __getattr__(self, name: str) -> Any:
            return getattr(holder["state"], name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(holder["state"], name, value)

    app = make_stub_app(Proxy())  # type: ignore[arg-type]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.01)
    yield Stub(f"http://127.0.0.1:{sock.getsockname()[1]}", holder)
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def stub(stub_server: Stub) -> Stub:
    stub_server.holder["state"] = StubState()
    return stub_server


def bench_args(*extra: str) -> list[str]:
    return ["bench", "serve", *extra]


def parse(*extra: str) -> Any:
    return build_parser().parse_args(bench_args(*extra))


def test_json_contract_counts_and_hit_rate_delta(stub: Stub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                  ) -> None:
    stub.state.first_delay, stub.state.gap = 0.005, 0.002
    rc = main(bench_args("--base-url", stub.base, "--num-prompts", "6", "--random-prefix-len", "64",
                         "--random-input-len", "32", "--random-output-len", "5", "--max-concurrency", "1",
                         "--json", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"))
    out = capsys.readouterr().out
    assert rc == 0
    res = json.loads(out.strip().splitlines()[-1])
    assert (res["completed"], res["failed"], res["num_prompts"]) == (6, 0, 6)
    assert (res["total_output_tokens"], res["total_input_tokens"]) == (30, 6 * 96)
    # Sequential: the first request hits nothing, each later one exactly the shared 64-token prefix; the
    # 1000/700 the counters held before the run must not leak in.
    assert res["prefix_cache_queries"] == 6 * 96 and res["prefix_cache_hits"] == 5 * 64
    assert res["prefix_hit_rate"] == pytest.approx(5 * 64 / (6 * 96), abs=1e-12)
    assert res["cached_tokens"] == 5 * 64 and res["output_len_mismatches"] == 0
    for key in ("request_throughput", "output_tokens_per_s", "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms",
                "itl_p99_ms", "e2el_median_ms", "total_tokens_per_s"):
        assert isinstance(res[key], float) and res[key] > 0, key
    assert res["model"] == "stub-model" and res["request_rate"] == "inf"
    assert json.loads((tmp_path / "r.json").read_text()) == res
    assert "prefix hit rate (/metrics)" in out and "TTFT" in out
    sent = stub.state.payloads
    assert len(sent) == 6 and all(p["model"] == "stub-model" and p["max_tokens"] == 5 and p["ignore_eos"] is True
                                  and p["stream"] is True and p["temperature"] == 0
                                  and p["stream_options"] == {"include_usage": True} for p in sent)
    assert all(len(p["prompt"]) == 96 and all(isinstance(t, int) for t in p["prompt"]) for p in sent)


def test_latencies_follow_the_servers_delays(stub: Stub) -> None:
    stub.state.first_delay, stub.state.gap = 0.08, 0.03
    reqs = [BenchRequest(list(range(1000, 1020)), 5) for _ in range(4)]
    out = asyncio.run(run_benchmark(stub.base, "/v1/completions", None, reqs, np.zeros(4), 2, 30.0))
    res = summarize(out["results"], out["duration"], out["metrics_before"], out["metrics_after"], [5] * 4)
    assert (res["completed"], res["failed"], res["total_output_tokens"]) == (4, 0, 20)
    # Lower bounds are the stub's sleeps; the upper slack absorbs a loaded 2-core machine, yet stays below
    # the 280 ms the second pair would show if its wait for a concurrency slot counted as TTFT.
    ok = out["results"]
    assert all(80 <= r.ttft * 1e3 < 200 for r in ok) and 80 <= res["ttft_mean_ms"] < 200
    assert 30 <= res["tpot_mean_ms"] < 70
    assert 30 <= res["itl_median_ms"] < 70 and len([g for r in ok for g in r.itl]) == 4 * 4
    assert 80 + 4 * 30 <= res["e2el_mean_ms"] < 450
    assert res["tpot_mean_ms"] == pytest.approx(np.mean([(r.latency - r.ttft) / 4 * 1e3 for r in ok]))
    # Two at a time: the second pair starts when the first ends, so the run lasts about two requests.
    assert 2 * 0.2 <= out["duration"] < 1.2 and stub.state.max_in_flight == 2


def test_concurrency_limit_and_unbounded_burst(stub: Stub) -> None:
    stub.state.first_delay = 0.2
    reqs = [BenchRequest([1000 + i], 2) for i in range(6)]
    asyncio.run(run_benchmark(stub.base, "/v1/completions", "m", reqs, np.zeros(6), 3, 30.0))
    assert stub.state.max_in_flight == 3
    stub.state.max_in_flight = 0
    asyncio.run(run_benchmark(stub.base, "/v1/completions", "m", reqs, np.zeros(6), None, 30.0))
    assert stub.state.max_in_flight == 6


def test_error_responses_count_as_failed_with_their_message(stub: Stub, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    stub.state.max_prompt_len = 100
    trace = tmp_path / "t.jsonl"
    lines = [dict(id=f"r{i}", prompt=[1000 + i] * n, decode=[5] * 3) for i, n in enumerate([50, 150, 60, 200])]
    trace.write_text("".join(json.dumps(r) + "\n" for r in lines))
    rc = main(bench_args("--base-url", stub.base, "--dataset-name", "trace", "--dataset-path", str(trace), "--json"))
    cap = capsys.readouterr()
    assert rc == 0
    res = json.loads(cap.out.strip().splitlines()[-1])
    assert (res["completed"], res["failed"], res["total_output_tokens"], res["total_input_tokens"]) == (2, 2, 6, 110)
    msgs = {e["message"]: e["count"] for e in res["errors"]}
    assert msgs == {"HTTP 400: This model's maximum context length is 100 tokens; the prompt has 150": 1,
                    "HTTP 400: This model's maximum context length is 100 tokens; the prompt has 200": 1}
    assert "1 failed: HTTP 400: This model's maximum context length is 100 tokens; the prompt has 200" in cap.err


def test_without_usage_tokens_are_counted_from_chunks_and_no_metrics_gives_no_hit_rate(
        stub: Stub, capsys: pytest.CaptureFixture[str]) -> None:
    stub.state.omit_usage, stub.state.no_metrics = True, True
    rc = main(bench_args("--base-url", stub.base, "--num-prompts", "3", "--random-input-len", "8",
                         "--random-output-len", "7", "--json", "--model", "x"))
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and (res["completed"], res["total_output_tokens"], res["cached_tokens"]) == (3, 21, 0)
    assert res["prefix_hit_rate"] is None and res["prefix_cache_queries"] is None
    assert "n/a (no prefix-cache counters)" in out


def test_max_duration_cancels_outstanding_and_unsent_requests(stub: Stub, capsys: pytest.CaptureFixture[str]) -> None:
    stub.state.gap = 0.5  # 50 tokens: 25 s per request, far past the bound
    t0 = time.perf_counter()
    rc = main(bench_args("--base-url", stub.base, "--num-prompts", "20", "--request-rate", "4",
                         "--random-input-len", "8", "--random-output-len", "50", "--max-duration", "1", "--json"))
    wall = time.perf_counter() - t0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and wall < 4 and res["timed_out"] is True
    assert (res["completed"], res["failed"]) == (0, 20)
    msgs = {e["message"]: e["count"] for e in res["errors"]}
    n_sent = int((arrival_offsets(20, 4, 0) < 1.0).sum())
    assert 0 < n_sent < 20
    assert msgs == {"cancelled: --max-duration reached": n_sent, "not sent before --max-duration": 20 - n_sent}


def test_only_loopback_targets(capsys: pytest.CaptureFixture[str]) -> None:
    for ok in ("http://127.0.0.1:8000", "http://127.3.2.1", "http://localhost:9", "http://[::1]:8000/"):
        check_loopback(ok)
    for bad in ("http://10.0.0.1:8000", "http://192.168.1.2", "http://example.com", "http://localhost.example.com",
                "http://[2001:db8::1]:80", "ftp://127.0.0.1"):
        with pytest.raises(ValueError, match="base_url"):
            check_loopback(bad)
    assert base_url_of(parse("--host", "::1", "--port", "9")) == "http://[::1]:9"
    assert base_url_of(parse("--base-url", "http://localhost:8000/")) == "http://localhost:8000"
    assert main(bench_args("--host", "8.8.8.8")) == 2
    assert main(bench_args("--base-url", "http://10.1.2.3:8000")) == 2
    err = capsys.readouterr().err
    assert "kvpool: error: base_url: 'http://8.8.8.8:8000' is not a loopback address" in err
    assert "'http://10.1.2.3:8000' is not a loopback address" in err


def test_same_seed_same_prompts_and_arrivals() -> None:
    a = parse("--num-prompts", "50", "--random-input-len", "30", "--random-range-ratio", "0.5", "--seed", "3")
    b = parse("--num-prompts", "50", "--random-input-len", "30", "--random-range-ratio", "0.5", "--seed", "4")
    assert build_requests(a) == build_requests(a)
    assert build_requests(a) != build_requests(b)
    assert np.array_equal(arrival_offsets(50, 2.0, 3), arrival_offsets(50, 2.0, 3))
    assert not np.array_equal(arrival_offsets(50, 2.0, 3), arrival_offsets(50, 2.0, 4))
    assert np.array_equal(arrival_offsets(7, float("inf"), 3), np.zeros(7))
    gaps = np.diff(arrival_offsets(20001, 5.0, 0))
    # Exponential gaps: mean 1/rate and standard deviation equal to the mean.
    assert gaps.mean() == pytest.approx(0.2, rel=0.03) and gaps.std() == pytest.approx(0.2, rel=0.05)
    assert arrival_offsets(3, 5.0, 0)[0] == 0.0


def test_random_prefix_is_shared_exactly_and_lengths_follow_the_ratio() -> None:
    reqs = build_requests(parse("--num-prompts", "40", "--random-prefix-len", "40", "--random-input-len", "20",
                                "--random-range-ratio", "0.5", "--random-output-len", "10"))
    assert len(reqs) == 40 and all(r.prompt[:40] == reqs[0].prompt[:40] for r in reqs)
    tails = [tuple(r.prompt[40:]) for r in reqs]
    assert len(set(tails)) == 40 and all(10 <= len(t) <= 30 for t in tails)
    assert len({len(t) for t in tails}) > 1 and all(5 <= r.output_len <= 15 for r in reqs)
    assert all(1000 <= t < 40000 for r in reqs for t in r.prompt)


def test_prefix_repetition_and_shared_prefix_datasets() -> None:
    reqs = build_requests(parse("--dataset-name", "prefix-repetition", "--num-prompts", "12",
                                "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "8",
                                "--prefix-repetition-num-prefixes", "3", "--prefix-repetition-output-len", "4"))
    prefixes = collections.Counter(tuple(r.prompt[:32]) for r in reqs)
    assert sorted(prefixes.values()) == [4, 4, 4] and all(len(r.prompt) == 40 and r.output_len == 4 for r in reqs)
    reqs = build_requests(parse("--dataset-name", "shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group",
                                "3", "--gsp-system-prompt-len", "20", "--gsp-question-len", "5"))
    assert len(reqs) == 6 and len({tuple(r.prompt[:20]) for r in reqs}) == 2 and all(len(r.prompt) == 25 for r in reqs)
    with pytest.raises(ValueError, match=r"num_prompts: shared-prefix sends groups x prompts per group = 6"):
        build_requests(parse("--dataset-name", "shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group",
                             "3", "--num-prompts", "5"))


def test_bad_input_names_the_field() -> None:
    cases = {("--random-range-ratio", "1.0"): "random_range_ratio", ("--num-prompts", "0"): "num_prompts",
             ("--num-prompts", "10001"): "num_prompts",
             ("--token-id-low", "50", "--token-id-high", "50"): "token_id_low",
             ("--dataset-name", "trace"): "dataset_path", ("--random-output-len", "0"): "random_output_len"}
    for flags, name in cases.items():
        with pytest.raises(ValueError, match=f"^{name}: "):
            build_requests(parse(*flags))
    with pytest.raises(ValueError, match=r"^request_rate: "):
        arrival_offsets(3, 0.0, 0)


def test_prefix_counters_from_either_prefix_summed_over_labels() -> None:
    vllm = ('# TYPE vllm:prefix_cache_queries counter\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0\n'
            '# TYPE vllm:prefix_cache_hits counter\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 15.0\n')
    assert prefix_cache_counters(vllm) == (150.0, 45.0)
    st = StubState()
    assert prefix_cache_counters(generate_latest(st.registry).decode()) == (1000.0, 700.0)
    only_queries = "# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total 5\n"
    assert prefix_cache_counters(only_queries) is None
    assert prefix_cache_counters("") is None


def test_a_run_where_every_request_failed_exits_1_after_its_report(stub: Stub, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong --model or --endpoint: the table and JSON still come (they say why), then exit 1, not 0."""
    stub.state.max_prompt_len = 10
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(dict(id=f"r{i}", prompt=[1000] * 50, decode=[5])) + "\n" for i in range(2)))
    rc = main(bench_args("--base-url", stub.base, "--dataset-name", "trace", "--dataset-path", str(trace), "--json"))
    cap = capsys.readouterr()
    assert rc == 1 and json.loads(cap.out.strip().splitlines()[-1])["failed"] == 2
    assert "kvpool: error: all 2 requests failed (first error: HTTP 400: This model's maximum context" in cap.err
    rc = main(bench_args("--base-url", stub.base, "--save-result", "--result-dir", str(tmp_path), "--result-filename",
                         "missing/r.json"))
    assert rc == 2 and "result_filename: its folder" in capsys.readouterr().err
