"""`kvpool bench serve`: a load generator for OpenAI-compatible servers (kvpool's own, or vLLM's).

Sends token-id prompts to `/v1/completions` with streaming (the `images` dataset: chats with one picture
each, as a PNG data URL, to `/v1/chat/completions`), at Poisson arrival times (`--request-rate`,
`inf` sends everything at once) under an optional `--max-concurrency`, and reports request throughput,
output and total tokens/s, TTFT / TPOT / ITL / end-to-end latency (mean, median, p99) and the server's
prefix-cache hit rate over the run (the delta of its /metrics counters). The flags follow
`vllm bench serve` where they apply. Loopback targets only; every run is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvpool.bench.report import BenchFailed, emit, format_table
from kvpool.bench.workloads import generated_shared_prefix, load_trace
from kvpool.server.options import port_number

MAX_NUM_PROMPTS = 10_000
DATASETS = ("random", "prefix-repetition", "shared-prefix", "trace", "images")
# Counter names of the server's prefix cache, in tokens; vLLM exports the same under its own prefix.
METRIC_PREFIXES = ("kvpool:", "vllm:")


@dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int
    image_url: str | None = None  # a chat request: this picture (a data URL), then `text`
    text: str = ""


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default=None, help="server root (default http://HOST:PORT); loopback only")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=port_number, default=8000)
    g.add_argument("--endpoint", default="/v1/completions")
    g.add_argument("--model", default=None, help="model name to send (default: the first id of GET /v1/models)")
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests to send (default 1000; at most {MAX_NUM_PROMPTS}; shared-prefix: groups x "
                        "prompts per group; trace: the whole file)")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends every request at once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 is Poisson, <1 burstier, >1 more regular")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument("--max-duration", type=float, default=600.0,
                   help="seconds; then outstanding requests are cancelled and counted failed")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server for exactly the requested output length (vLLM's extension; default on)")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="trace: JSON lines {id, prompt: [ids], decode: [ids]}")
    g.add_argument("--token-id-low", type=int, default=1000, help="random token ids are drawn from [low, high)")
    g.add_argument("--token-id-high", type=int, default=40000,
                   help="default range avoids SmolLM2's special tokens (vocab 49152)")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-prefix-len", type=int, default=0, help="tokens shared by every random prompt")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="input/output lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--gsp-num-groups", type=int, default=8, help="shared-prefix: system prompts")
    g.add_argument("--gsp-prompts-per-group", type=int, default=8)
    g.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    g.add_argument("--gsp-question-len", type=int, default=64)
    g.add_argument("--gsp-output-len", type=int, default=32)
    g.add_argument("--images-num-unique", type=int, default=4,
                   help="images: distinct random PNGs; requests draw from them, so pictures repeat (encoder and "
                        "prefix caches) when there are more requests than pictures")
    g.add_argument("--images-width", type=int, default=256)
    g.add_argument("--images-height", type=int, default=256)
    g.add_argument("--images-prompt", default="Describe this image.", help="images: the text after the picture")
    g.add_argument("--images-output-len", type=int, default=32)
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    g.add_argument("--save-result", action="store_true", help="also write the JSON result to a file")
    g.add_argument("--result-dir", default=None, help="with --save-result: the folder (default: the current one)")
    g.add_argument("--result-filename", default=None,
                   help="with --save-result: the file's name (default: "
                        "kvpool-bench-serve-DATASET-RATEqps-YYYYmmdd-HHMMSS.json)")


def base_url_of(a: argparse.Namespace) -> str:
    url = a.base_url if a.base_url else f"http://{_bracket(a.host)}:{a.port}"
    check_loopback(url)
    return url.rstrip("/")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_loopback(url: str) -> None:
    """Refuse any target but this machine: a load test must never leave it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"base_url: {url!r} is not an http(s) URL")
    try:
        parts.port  # noqa: B018 (it raises for a port that is not a number in 0..65535)
    except ValueError as e:
        raise ValueError(f"base_url: {url!r} has no valid port ({e})") from None
    host = parts.hostname or ""
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"base_url: {url!r} is not a loopback address; kvpool bench serve only targets "
                         "127.0.0.0/8, ::1 or localhost")


def _need(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {what}")


def build_requests(a: argparse.Namespace) -> list[BenchRequest]:
    """The dataset, deterministic for `--seed`."""
    n = a.num_prompts
    _need(n is None or 1 <= n <= MAX_NUM_PROMPTS, "num_prompts", f"must be in [1, {MAX_NUM_PROMPTS}], got {n}")
    lo, hi = a.token_id_low, a.token_id_high
    _need(0 <= lo < hi, "token_id_low", f"need 0 <= token_id_low < token_id_high, got [{lo}, {hi})")
    _need(a.dataset_path is None or a.dataset_name == "trace", "dataset_path",
          f"only the trace dataset reads a file; --dataset-name {a.dataset_name} would ignore it")
    rng = np.random.default_rng(a.seed)

    def toks(k: int) -> list[int]:
        return rng.integers(lo, hi, size=k).tolist()

    if a.dataset_name == "random":
        n = 1000 if n is None else n
        r = a.random_range_ratio
        _need(0.0 <= r < 1.0, "random_range_ratio", f"must be in [0, 1), got {r}")
        _need(a.random_input_len >= 0, "random_input_len", f"must be >= 0, got {a.random_input_len}")
        _need(a.random_output_len >= 1, "random_output_len", f"must be >= 1, got {a.random_output_len}")
        _need(a.random_prefix_len >= 0, "random_prefix_len", f"must be >= 0, got {a.random_prefix_len}")
        in_lens = rng.integers(int(a.random_input_len * (1 - r)), int(a.random_input_len * (1 + r)) + 1, size=n)
        out_lens = rng.integers(max(1, int(a.random_output_len * (1 - r))), int(a.random_output_len * (1 + r)) + 1,
                                size=n)
        prefix = toks(a.random_prefix_len)
        reqs = [BenchRequest(prefix + toks(int(k)), int(o)) for k, o in zip(in_lens, out_lens, strict=True)]
        _need(all(q.prompt for q in reqs), "random_input_len", "a prompt came out empty: raise the lengths")
        return reqs
    if a.dataset_name == "prefix-repetition":
        n = 1000 if n is None else n
        k = a.prefix_repetition_num_prefixes
        _need(k >= 1, "prefix_repetition_num_prefixes", f"must be >= 1, got {k}")
        _need(a.prefix_repetition_prefix_len >= 0, "prefix_repetition_prefix_len", "must be >= 0")
        _need(a.prefix_repetition_suffix_len >= 0, "prefix_repetition_suffix_len", "must be >= 0")
        _need(a.prefix_repetition_prefix_len + a.prefix_repetition_suffix_len >= 1, "prefix_repetition_suffix_len",
              "prefix and suffix are both empty")
        _need(a.prefix_repetition_output_len >= 1, "prefix_repetition_output_len", "must be >= 1")
        prefixes = [toks(a.prefix_repetition_prefix_len) for _ in range(k)]
        reqs = [BenchRequest(prefixes[i % k] + toks(a.prefix_repetition_suffix_len), a.prefix_repetition_output_len)
                for i in range(n)]
        order = rng.permutation(n)
        return [reqs[i] for i in order]
    if a.dataset_name == "shared-prefix":
        _need(min(a.gsp_num_groups, a.gsp_prompts_per_group) >= 1, "gsp_num_groups",
              "groups and prompts per group must be >= 1")
        _need(a.gsp_system_prompt_len + a.gsp_question_len >= 1, "gsp_question_len", "prompts would be empty")
        _need(a.gsp_output_len >= 1, "gsp_output_len", f"must be >= 1, got {a.gsp_output_len}")
        total = a.gsp_num_groups * a.gsp_prompts_per_group
        _need(n is None or n == total, "num_prompts",
              f"shared-prefix sends groups x prompts per group = {total} prompts; got --num-prompts {n}")
        _need(total <= MAX_NUM_PROMPTS, "num_prompts", f"{total} prompts exceed {MAX_NUM_PROMPTS}")
        prompts = generated_shared_prefix(a.gsp_num_groups, a.gsp_system_prompt_len, a.gsp_prompts_per_group,
                                          a.gsp_question_len, seed=a.seed, token_range=(lo, hi))
        return [BenchRequest(p, a.gsp_output_len) for p in prompts]
    if a.dataset_name == "trace":
        _need(bool(a.dataset_path), "dataset_path", "the trace dataset needs --dataset-path")
        trace = load_trace(a.dataset_path)
        _need(bool(trace), "dataset_path", f"{a.dataset_path} holds no request")
        trace = trace[:n] if n is not None else trace
        _need(len(trace) <= MAX_NUM_PROMPTS, "num_prompts", f"{len(trace)} trace lines exceed {MAX_NUM_PROMPTS}; "
              "pass --num-prompts")
        for r in trace:
            _need(len(r["prompt"]) >= 1 and len(r["decode"]) >= 1, "dataset_path",
                  f"request {r['id']!r} has an empty prompt or decode")
        return [BenchRequest(list(r["prompt"]), len(r["decode"])) for r in trace]
    if a.dataset_name == "images":
        n = 100 if n is None else n
        k, w, h = a.images_num_unique, a.images_width, a.images_height
        _need(k >= 1, "images_num_unique", f"must be >= 1, got {k}")
        _need(min(w, h) >= 1 and w * h <= 4096 * 4096, "images_width", f"need 1 <= width, height and width x "
              f"height <= 4096 x 4096, got {w} x {h}")
        _need(a.images_output_len >= 1, "images_output_len", f"must be >= 1, got {a.images_output_len}")
        picks = [int(i) for i in rng.integers(0, k, size=n)]
        # Picture i comes from its own seeded stream: the same picture whatever n and k, made only if drawn.
        urls = {i: random_png_url(np.random.default_rng([a.seed, 2, i]), w, h) for i in sorted(set(picks))}
        return [BenchRequest([], a.images_output_len, urls[i], a.images_prompt) for i in picks]
    raise ValueError(f"dataset_name: unknown dataset {a.dataset_name!r}")


def random_png_url(rng: np.random.Generator, width: int, height: int) -> str:
    """A random-noise RGB picture as a PNG data URL (noise: PNG cannot shrink it, so sizes are honest)."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def arrival_offsets(n: int, rate: float, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """Send times in seconds from the start: gamma-distributed gaps of mean 1/rate (Poisson at burstiness 1)."""
    _need(rate > 0, "request_rate", f"must be > 0 or inf, got {rate}")
    _need(math.isfinite(burstiness) and burstiness > 0, "burstiness", f"must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    # Its own stream, so the arrival times do not move when the dataset's draws change.
    gaps = np.random.default_rng([seed, 1]).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    # (a shape so small the gaps overflow or vanish into NaN would send everything at once, silently)
    _need(bool(np.isfinite(gaps).all()), "burstiness", f"{burstiness} gives gaps no clock can wait (not finite)")
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def prefix_cache_counters(text: str) -> tuple[float, float] | None:
    """(queries, hits) summed over label sets, from a Prometheus exposition; None when the server has none."""
    from prometheus_client.parser import text_string_to_metric_families

    for prefix in METRIC_PREFIXES:
        want = {f"{prefix}prefix_cache_queries_total": 0, f"{prefix}prefix_cache_hits_total": 1}
        seen = [0.0, 0.0]
        found = [False, False]
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in want:
                    seen[want[s.name]] += s.value
                    found[want[s.name]] = True
        if all(found):
            return seen[0], seen[1]
    return None


async def _scrape(client: Any, base: str) -> tuple[float, float] | None:
    import httpx

    try:
        r = await client.get(f"{base}/metrics")
    except httpx.HTTPError:
        return None
    return prefix_cache_counters(r.text) if r.status_code == 200 else None


async def _model_name(client: Any, base: str) -> str:
    import httpx

    try:
        r = await client.get(f"{base}/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
        raise ValueError(f"model: not given, and GET {base}/v1/models gave no model id ({e!r})") from e


def _error_text(status: int, body: bytes) -> str:
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body.decode(errors="replace")[:300]
    return f"HTTP {status}: {msg}"


async def _send(client: Any, url: str, model: str, req: BenchRequest, ignore_eos: bool) -> RequestResult:
    import httpx

    payload: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                               "stream_options": {"include_usage": True}}
    if req.image_url is not None:
        payload["messages"] = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": req.image_url}},
                                                           {"type": "text", "text": req.text}]}]
    else:
        payload["prompt"] = req.prompt
    if ignore_eos:
        payload["ignore_eos"] = True
    res = RequestResult(prompt_len=len(req.prompt))
    chunks = 0
    usage_tokens: int | None = None
    st = time.perf_counter()
    last = st
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code >= 400:
                res.error = _error_text(resp.status_code, await resp.aread())
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    err = obj["error"]
                    res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return res
                now = time.perf_counter()
                # A chat stream opens with a chunk holding only the role: no token yet, so no TTFT.
                if obj.get("choices") and obj["choices"][0].get("delta", {}).get("role") is None:
                    if chunks == 0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    chunks += 1
                    last = now
                if usage := obj.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
                    res.prompt_len = usage.get("prompt_tokens") or res.prompt_len
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - st
    if chunks == 0:
        res.error = "the stream carried no output"
        return res
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.success = True
    return res


async def run_benchmark(base: str, endpoint: str, model: str | None, reqs: list[BenchRequest],
                        offsets: np.ndarray, max_concurrency: int | None, max_duration: float,
                        ignore_eos: bool = True) -> dict[str, Any]:
    """Send every request at its offset; return per-request results, wall time and the metrics delta."""
    import httpx

    _need(max_duration > 0, "max_duration", f"must be > 0, got {max_duration}")
    _need(max_concurrency is None or max_concurrency >= 1, "max_concurrency", f"must be >= 1, got {max_concurrency}")
    limit = max_concurrency or len(reqs)
    # trust_env=False: no proxy from the environment may carry loopback traffic elsewhere.
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(None, connect=10.0),
                                 limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as client:
        model = model or await _model_name(client, base)
        before = await _scrape(client, base)
        sem = asyncio.Semaphore(limit)
        results: list[RequestResult | None] = [None] * len(reqs)
        sent = [False] * len(reqs)
        tasks: list[asyncio.Task[None]] = []

        async def one(i: int) -> None:
            async with sem:
                sent[i] = True
                results[i] = await _send(client, base + endpoint, model, reqs[i], ignore_eos)

        async def dispatch() -> None:
            for i, off in enumerate(offsets):
                delay = t0 + float(off) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)

        t0 = time.perf_counter()
        timed_out = False
        try:
            async with asyncio.timeout(max_duration):
                await dispatch()
        except TimeoutError:
            timed_out = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - t0
        after = await _scrape(client, base)
    final = [r if r is not None else RequestResult(
        prompt_len=len(q.prompt),
        error="cancelled: --max-duration reached" if sent[i] else "not sent before --max-duration")
        for i, (r, q) in enumerate(zip(results, reqs, strict=True))]
    return dict(model=model, results=final, duration=duration, timed_out=timed_out, metrics_before=before,
                metrics_after=after)


def _stats(name: str, xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {f"{name}_mean_ms": None, f"{name}_median_ms": None, f"{name}_p99_ms": None}
    arr = np.asarray(xs) * 1e3
    return {f"{name}_mean_ms": float(arr.mean()), f"{name}_median_ms": float(np.median(arr)),
            f"{name}_p99_ms": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float, before: tuple[float, float] | None,
              after: tuple[float, float] | None, expected_output: list[int]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    errors = Counter(r.error for r in results if not r.success)
    res: dict[str, Any] = dict(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
        request_throughput=len(ok) / duration if duration > 0 else 0.0,
        output_tokens_per_s=out_tokens / duration if duration > 0 else 0.0,
        total_tokens_per_s=(in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        cached_tokens=sum(r.cached_tokens for r in ok),
        # Completed requests whose output length differs from the one asked for (a server ignoring ignore_eos).
        output_len_mismatches=sum(r.output_tokens != e for r, e in zip(results, expected_output, strict=True)
                                  if r.success),
    )
    res |= _stats("ttft", [r.ttft for r in ok])
    # TPOT per request, excluding the first token: the decode speed a user sees once output has started.
    res |= _stats("tpot", [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    res |= _stats("itl", [g for r in ok for g in r.itl])
    res |= _stats("e2el", [r.latency for r in ok])
    if before is not None and after is not None:
        dq, dh = after[0] - before[0], after[1] - before[1]
        res |= dict(prefix_cache_queries=dq, prefix_cache_hits=dh, prefix_hit_rate=dh / dq if dq > 0 else None)
    else:
        res |= dict(prefix_cache_queries=None, prefix_cache_hits=None, prefix_hit_rate=None)
    res["errors"] = [{"message": m, "count": c} for m, c in errors.most_common(5)]
    return res


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:,.2f}{unit}"


def render(res: dict[str, Any]) -> str:
    hit = res["prefix_hit_rate"]
    summary = [
        ["successful requests", str(res["completed"])],
        ["failed requests", str(res["failed"])],
        ["benchmark duration (s)", _fmt(res["duration_s"])],
        ["total input tokens", str(res["total_input_tokens"])],
        ["total output tokens", str(res["total_output_tokens"])],
        ["cached prompt tokens (usage)", str(res["cached_tokens"])],
        ["request throughput (req/s)", _fmt(res["request_throughput"])],
        ["output token throughput (tok/s)", _fmt(res["output_tokens_per_s"])],
        ["total token throughput (tok/s)", _fmt(res["total_tokens_per_s"])],
        ["prefix hit rate (/metrics)", "n/a (no prefix-cache counters)" if res["prefix_cache_queries"] is None
         else ("-" if hit is None else f"{hit:.4f}")],
    ]
    lat = [[label, _fmt(res[f"{k}_mean_ms"]), _fmt(res[f"{k}_median_ms"]), _fmt(res[f"{k}_p99_ms"])]
           for label, k in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2el"))]
    return (format_table(["metric", "value"], summary) + "\n\n"
            + format_table(["latency (ms)", "mean", "median", "p99"], lat))


def run(a: argparse.Namespace) -> dict[str, Any]:
    base = base_url_of(a)
    # httpx logs every request at INFO, which would bury the table.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _need(a.endpoint.startswith("/"), "endpoint", f"must start with '/', got {a.endpoint!r}")
    for flag in ("result_dir", "result_filename"):  # (without --save-result nothing is written: refused, not ignored)
        _need(a.save_result or getattr(a, flag) is None, flag, "only read with --save-result, which is not given")
    shown = a.result_dir or "."
    result_dir = Path(shown)
    if a.save_result:  # checked now: found after the load test, the result would be lost with the error
        _need(result_dir.is_dir(), "result_dir", f"{shown!r} is not a directory")
        _need(os.access(result_dir, os.W_OK | os.X_OK), "result_dir", f"{shown!r} is not writable")
        if a.result_filename is not None:
            _need(a.result_filename.strip() != "", "result_filename", "must not be empty")
            folder = (result_dir / a.result_filename).parent
            _need(folder.is_dir() and os.access(folder, os.W_OK | os.X_OK), "result_filename",
                  f"its folder {str(folder)!r} is not a writable directory")
    reqs = build_requests(a)
    endpoint = a.endpoint
    if a.dataset_name == "images" and endpoint == "/v1/completions":
        endpoint = "/v1/chat/completions"  # pictures travel in chat content parts
    offsets = arrival_offsets(len(reqs), a.request_rate, a.seed, a.burstiness)
    out = asyncio.run(run_benchmark(base, endpoint, a.model, reqs, offsets, a.max_concurrency, a.max_duration,
                                    a.ignore_eos))
    res = summarize(out["results"], out["duration"], out["metrics_before"], out["metrics_after"],
                    [q.output_len for q in reqs])
    res |= dict(num_prompts=len(reqs), timed_out=out["timed_out"], model=out["model"], base_url=base,
                endpoint=endpoint, dataset_name=a.dataset_name, request_rate=a.request_rate,
                burstiness=a.burstiness, max_concurrency=a.max_concurrency, seed=a.seed, ignore_eos=a.ignore_eos,
                date=datetime.now().strftime("%Y%m%d-%H%M%S"))
    # Non-finite floats (--request-rate inf) would make the JSON invalid for strict parsers.
    res = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in res.items()}
    for e in res["errors"]:
        print(f"kvpool bench serve: {e['count']} failed: {e['message']}", file=sys.stderr)
    emit(render(res), res, a.json)
    if a.save_result:
        name = a.result_filename or f"kvpool-bench-serve-{a.dataset_name}-{a.request_rate}qps-{res['date']}.json"
        path = result_dir / name
        path.write_text(json.dumps(res, indent=2) + "\n")
        print(f"kvpool bench serve: result written to {path}", file=sys.stderr)
    if reqs and not res["completed"] and not res["timed_out"]:  # (a wrong --model or --endpoint: all refused)
        raise BenchFailed(f"all {len(reqs)} requests failed (first error: {res['errors'][0]['message']})"
                          if res["errors"] else f"all {len(reqs)} requests failed")
    return res
