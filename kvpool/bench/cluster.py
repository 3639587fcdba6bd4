"""`kvpool bench cluster`: N replicas behind a router on loopback, multi-turn chats, several routing set-ups.

Real processes: two `kvpool serve` replicas (one thread each, small device pools, KV events on), one
`kvpool serve` replica whose pool holds everything (the hit-rate ceiling, and with a unique cache salt per
request the no-cache reference), and the router (`kvpool.router`, in this process) in front of the two.
Conversations come from the same generator as `kvpool bench multiturn` (make_trace's multi-turn shape: a
shared system prompt, then user messages and answers), their turns interleaved at random with at most
`--concurrency` in flight; a turn is sent once its conversation's previous turn has finished, and the
history appends the trace's answers, so every system sees the same prompts. Every request streams, so
TTFT is measured at the client (the first chunk).

Systems (`--systems`): round-robin (the router's round-robin policy), router (cache-aware), ceiling (one
replica, pool holding everything), and round-robin+store, router+store: a second pair of replicas with a
host tier writing through to a shared store (a private redis-server unless `--kv-store` names one),
emptied between systems. After router+store, one of its replicas is killed and restarted (empty device and
host tiers) and its hit rate on the next turn of every conversation is compared with before the restart
(`restart_hit_ratio`).

Per system: hit rate (cached prompt tokens / prompt tokens, from each response's usage), the host tier's
and the store's parts of it (from the replicas' /metrics: blocks read from the store land in the host tier
and are hit there, so the store's part is the landed blocks, taken out of the host's), TTFT mean and p99
per turn and for later turns, throughput, bytes and round trips to the store, load balance (busiest
replica's requests over the mean), and whether every answer equals the reference's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvpool.bench.multiturn import arrival_order, conversations, span_flag, take_idle
from kvpool.bench.plots import plot_path, ttft_per_turn
from kvpool.bench.report import BenchFailed, emit, format_table, name_list, percentile
from kvpool.server.options import _positive, at_least

SYSTEMS = ("round-robin", "round-robin+store", "router", "router+store", "ceiling")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--conversations", type=_positive, default=8)
    p.add_argument("--turns", type=_positive, default=4)
    p.add_argument("--concurrency", type=_positive, default=4, help="requests in flight")
    p.add_argument("--system-len", type=at_least(0), default=256)
    p.add_argument("--user-len", type=span_flag, default="32:64", help="min:max tokens of a user message")
    p.add_argument("--answer-len", type=span_flag, default="8:16", help="min:max tokens of an answer")
    p.add_argument("--device-blocks", type=at_least(2), default=None,
                   help="device pool of each of the two replicas (default: 60%% of the working set, so that one "
                        "replica holds half the conversations but not all of them)")
    p.add_argument("--host-blocks", type=at_least(0), default=0, help="host tier of each of the two replicas")
    p.add_argument("--threads", type=_positive, default=1, help="torch threads per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="round-robin,router,ceiling")
    p.add_argument("--kv-store", default=None,
                   help="store of the +store systems (default: a private redis-server on loopback); the values "
                        "kvpool stored there are deleted before each system (nothing else in it)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="TTFT per turn, one line per system")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bytes_per_block(model_dir: Path, dtype: str, block_size: int = 16) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    elem = 4 if dtype == "float32" else 2
    return 2 * block_size * cfg.get("num_key_value_heads", heads) * head_dim * elem * cfg["num_hidden_layers"]


class Replica:
    """A `kvpool serve` process on loopback with KV events (PUB + replay)."""

    def __init__(self, model_dir: Path, a: argparse.Namespace, num_blocks: int, host_blocks: int, log_dir: Path,
                 name: str, extra: tuple[str, ...] = ()) -> None:
        self.port, self.pub, self.replay = _free_port(), _free_port(), _free_port()
        bpb = _bytes_per_block(model_dir, a.dtype)
        # 4096 tokens, or the model's context where it is shorter (a longer max_model_len is an error).
        context = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings") or 4096
        cmd = [sys.executable, "-m", "kvpool.cli", "serve", "--model", str(model_dir), "--dtype", a.dtype,
               "--port", str(self.port), "--kv-cache-memory", str(num_blocks * bpb), "--served-model-name", "m",
               "--max-model-len", str(min(4096, context)), "--max-num-batched-tokens", "1024",
               "--kv-events-endpoint", f"tcp://127.0.0.1:{self.pub}",
               "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{self.replay}"]
        if host_blocks:
            cmd += ["--swap-space", str(host_blocks * bpb)]
        self.cmd = cmd + list(extra)
        self.env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads),
                        TOKENIZERS_PARALLELISM="false")
        self.log = (log_dir / f"{name}.log").open("ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        self.url = f"http://127.0.0.1:{self.port}"

    def restart(self) -> None:
        """Kill the process (as a crash would) and start it again on the same ports: empty tiers."""
        self.proc.kill()
        self.proc.wait(20)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        self.wait()

    def wait(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchFailed(f"replica {self.url} exited at start (see {self.log.name})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.25)
        raise BenchFailed(f"replica {self.url} did not start in {timeout:.0f}s")

    def spec(self) -> Any:
        from kvpool.router.app import ReplicaSpec

        return ReplicaSpec(self.url, events=f"tcp://127.0.0.1:{self.pub}", replay=f"tcp://127.0.0.1:{self.replay}")

    def reset(self) -> None:
        r = httpx.post(f"{self.url}/reset_prefix_cache", timeout=30)
        if r.status_code != 200:
            raise BenchFailed(f"replica {self.url}: reset refused ({r.text})")

    def counters(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=10).text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def stop(self) -> None:
        if self.log.closed:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


async def drive(url: str, a: argparse.Namespace, system: list[int], convs: list[list[tuple]],
                salt_each: bool = False) -> dict[str, Any]:
    """Send every turn (interleaved, `concurrency` in flight); per request: turn, TTFT, text, usage, replica.

    A request that fails (an HTTP status other than 200, a broken connection) fails the run at once: a
    BenchFailed naming its conversation and turn, the requests still in flight cancelled."""
    order = arrival_order(a)
    history = [list(system) for _ in convs]
    turn = [0] * len(convs)
    results: list[dict[str, Any]] = []
    busy: set[int] = set()
    t0 = time.perf_counter()

    async with httpx.AsyncClient(timeout=600) as client:

        async def one(c: int) -> None:
            t = turn[c]
            user, ans = convs[c][t]
            history[c] += user
            body: dict[str, Any] = {"prompt": list(history[c]), "max_tokens": len(ans), "temperature": 0,
                                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if salt_each:
                body["cache_salt"] = f"ref-{c}-{t}"
            sent = time.perf_counter()
            ttft = None
            text, usage = "", None
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise BenchFailed(f"conversation {c} turn {t}: HTTP {r.status_code} from {url}: "
                                           f"{(await r.aread())[:300]!r}")
                    replica = r.headers.get("x-kvpool-replica", url)
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for ch in chunk.get("choices", ()):
                            if ttft is None:
                                ttft = time.perf_counter() - sent
                            text += ch.get("text", "")
            except httpx.HTTPError as e:
                raise BenchFailed(f"conversation {c} turn {t}: {url}: {e!r}") from e
            results.append({"conv": c, "turn": t, "ttft": ttft, "text": text, "replica": replica,
                            "prompt_tokens": usage["prompt_tokens"] if usage else len(history[c]),
                            "cached_tokens": (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0),
                            "completion_tokens": (usage or {}).get("completion_tokens", 0)})
            history[c] += ans
            turn[c] += 1
            busy.discard(c)
            refill()  # (before this task ends: `tasks` is empty only once every turn has been sent and answered)

        tasks: set[asyncio.Task[None]] = set()

        def refill() -> None:
            for c in take_idle(order, busy, a.concurrency):
                tasks.add(asyncio.ensure_future(one(c)))

        refill()
        try:
            while tasks:
                finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    tasks.discard(task)
                    task.result()  # (a failed request's exception, raised here)
        finally:  # failed: the requests still in flight are cancelled, not left running
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"wall_s": time.perf_counter() - t0, "results": results}


def summarize(run: dict[str, Any], reference: dict[tuple[int, int], str] | None, host_hits: float,
              store_hits: float, replicas: list[str]) -> dict[str, Any]:
    res = run["results"]
    prompt = sum(r["prompt_tokens"] for r in res)
    cached = sum(r["cached_tokens"] for r in res)
    ttfts = [r["ttft"] for r in res if r["ttft"] is not None]
    by_turn: dict[int, list[float]] = {}
    for r in res:
        if r["ttft"] is not None:
            by_turn.setdefault(r["turn"], []).append(r["ttft"])
    later = [x for t, xs in by_turn.items() if t > 0 for x in xs]
    counts = {u: sum(1 for r in res if r["replica"] == u) for u in replicas}
    mean = sum(counts.values()) / max(1, len(counts))
    identical = None if reference is None else all(reference.get((r["conv"], r["turn"])) == r["text"] for r in res)
    return {"requests": len(res), "wall_s": run["wall_s"], "hit_rate": cached / prompt if prompt else 0.0,
            "host_hit_rate": host_hits / prompt if prompt else 0.0,
            "store_hit_rate": store_hits / prompt if prompt else 0.0,
            "ttft_mean_ms": 1e3 * statistics.mean(ttfts), "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
            "ttft_mean_ms_later_turns": 1e3 * statistics.mean(later) if later else None,
            "ttft_p99_ms_later_turns": 1e3 * percentile(later, 99) if later else None,
            "ttft_mean_ms_by_turn": {t: 1e3 * statistics.mean(xs) for t, xs in sorted(by_turn.items())},
            "requests_per_s": len(res) / run["wall_s"],
            "output_tokens_per_s": sum(r["completion_tokens"] for r in res) / run["wall_s"],
            "requests_by_replica": list(counts.values()),
            "load_imbalance": max(counts.values()) / mean if mean else None,
            "outputs_identical": identical, "store_bytes": 0, "store_round_trips": 0}


# The command line's own fields, not the benchmark's configuration.
_NOT_CONFIG = ("func", "run", "with_engine", "command", "verbose")


def config_of(a: argparse.Namespace) -> dict[str, Any]:
    """The benchmark's flags as the JSON's `config` reports them."""
    return {k: v for k, v in vars(a).items() if k not in _NOT_CONFIG}


def check_store(url: str, names: list[str]) -> None:
    """`--kv-store URL` is for the +store systems, and must open and answer: a ValueError naming it otherwise."""
    from kvpool.store import StoreError, open_store

    if not any(n.endswith("+store") for n in names):
        raise ValueError("--kv-store: only the +store systems use a store, and --systems names none; add "
                         "round-robin+store or router+store, or leave --kv-store out")
    store = open_store(url)  # (a ValueError naming kv_store for a URL it cannot read)
    try:
        store.ping()
    except StoreError as e:
        raise ValueError(f"kv_store: cannot reach {url} ({e})") from None
    finally:
        store.close()


def _store_server(a: argparse.Namespace) -> tuple[Any, str]:
    """The shared store: `--kv-store URL` if given, else a private redis-server on loopback."""
    from kvpool.store.server import RedisServer, find_server_binary

    if a.kv_store:
        return None, a.kv_store
    binary = find_server_binary()
    if binary is None:
        raise ValueError("systems: the +store systems need a redis-server or valkey-server (or --kv-store URL)")
    srv = RedisServer(binary).start()
    return srv, srv.url


def _flush_store(url: str) -> None:
    """Empty the store between systems, so each starts cold: kvpool's values only (a folder or database
    given with --kv-store may hold other things)."""
    from kvpool.store import open_store

    store = open_store(url)
    try:
        store.clear()
    finally:
        store.close()


def _tier_tokens(replicas: list[Replica], before: list[dict[str, float]]) -> tuple[float, float]:
    """(host-tier hit tokens, store-sourced tokens) over the replicas since `before`. Blocks read from the
    store land in the host tier and are then hit there, so the store's part is taken out of the host's."""
    after = [r.counters() for r in replicas]

    def delta(name: str) -> float:
        return sum(x.get(name, 0.0) - y.get(name, 0.0) for x, y in zip(after, before, strict=True))

    store = 16 * delta("kvpool:store_landed_blocks_total")
    host = delta("kvpool:host_prefix_cache_hits_total")
    return max(0.0, host - store), store


def _run_system(name: str, a: argparse.Namespace, system: list[int], convs: list[list[tuple]],
                reference: dict[tuple[int, int], str], targets: list[Replica]) -> dict[str, Any]:
    from kvpool.router.app import Router, start_router

    for r in targets:
        r.reset()
    before = [r.counters() for r in targets]
    if len(targets) == 1:
        run_ = asyncio.run(drive(targets[0].url, a, system, convs))
    else:
        front = start_router(Router([r.spec() for r in targets], tokenizer=None, block_size=16,
                                    policy="round-robin" if name.startswith("round-robin") else "cache"))
        try:
            time.sleep(0.3)
            run_ = asyncio.run(drive(front.url, a, system, convs))
        finally:
            front.stop()
    host, store = _tier_tokens(targets, before)
    res = summarize(run_, reference, host, store, [r.url for r in targets])
    after = [r.counters() for r in targets]

    def delta(name: str) -> float:
        return sum(x.get(name, 0.0) - y.get(name, 0.0) for x, y in zip(after, before, strict=True))

    res["store_bytes"] = delta("kvpool:store_bytes_written_total") + delta("kvpool:store_bytes_read_total")
    res["store_round_trips"] = delta("kvpool:store_round_trips_total")
    return res


def _restart_probe(a: argparse.Namespace, system: list[int], convs: list[list[tuple]], rep: Replica
                   ) -> dict[str, Any]:
    """A replica's hit rate on the next turn of every conversation, sent to it directly, before and after
    it is killed and restarted (empty device and host tiers; the store keeps what it wrote)."""
    import random

    rng = random.Random(a.seed + 7)
    histories = []
    for c in convs:
        h = list(system)
        for user, ans in c:
            h += user + ans
        histories.append(h)

    def one_round() -> tuple[float, float]:
        async def go() -> tuple[float, float]:
            cached = total = 0
            async with httpx.AsyncClient(timeout=600) as client:
                for h in histories:
                    prompt = h + [rng.randrange(1000, 40000) for _ in range(16)]
                    r = await client.post(f"{rep.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                    if r.status_code != 200:
                        raise BenchFailed(f"restart probe: {rep.url} answered {r.status_code}: {r.text[:300]}")
                    u = r.json()["usage"]
                    cached += u["prompt_tokens_details"]["cached_tokens"]
                    total += u["prompt_tokens"]
            return cached, total

        return asyncio.run(go())

    one_round()  # the replica now holds (or has written to the store) every conversation
    cached, total = one_round()
    before_rate = cached / total
    rep.restart()
    c0 = rep.counters()
    cached, total = one_round()
    after_rate = cached / total
    landed = rep.counters().get("kvpool:store_landed_blocks_total", 0) - c0.get("kvpool:store_landed_blocks_total", 0)
    return {"hit_rate_before": before_rate, "hit_rate_after": after_rate,
            "ratio": after_rate / before_rate if before_rate else None, "store_blocks_after": int(landed)}


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvpool.runner.model_files import resolve_model

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the table
    plot_path(a.plot)
    names = name_list("systems", a.systems, SYSTEMS)
    if a.kv_store is not None:  # (checked before any replica starts: found later, a bad store cost the run)
        check_store(a.kv_store, names)
    model_dir = resolve_model(a.model)
    system, convs = conversations(a)
    working_set = sum(-(-(a.system_len + sum(len(u) + len(x) for u, x in c)) // 16) for c in convs) + 16
    if a.device_blocks is None:
        a.device_blocks = max(32, int(0.6 * working_set))
    log_dir = Path(tempfile.mkdtemp(prefix="kvpool-bench-cluster-"))
    out: dict[str, Any] = {"config": config_of(a), "working_set_blocks": working_set, "systems": {}}
    plain = [n for n in names if not n.endswith("+store")]
    stored = [n for n in names if n.endswith("+store")]
    big = Replica(model_dir, a, max(2 * working_set, a.device_blocks), 0, log_dir, "ceiling")
    pair = [Replica(model_dir, a, a.device_blocks, a.host_blocks, log_dir, f"replica{i}") for i in range(2)]
    started: list[Replica] = [big, *pair]
    server = None
    try:
        for r in started:
            r.wait()
        # The reference: every request with its own cache salt (no hit possible), on the roomy replica.
        ref_run = asyncio.run(drive(big.url, a, system, convs, salt_each=True))
        reference = {(r["conv"], r["turn"]): r["text"] for r in ref_run["results"]}
        out["reference"] = summarize(ref_run, None, 0.0, 0.0, [big.url])
        for name in plain:
            out["systems"][name] = _run_system(name, a, system, convs, reference, [big] if name == "ceiling" else pair)
        big.stop()
        for r in pair:
            r.stop()
        if stored:
            server, url = _store_server(a)
            host_blocks = a.host_blocks or a.device_blocks
            spair = [Replica(model_dir, a, a.device_blocks, host_blocks, log_dir, f"store-replica{i}",
                             extra=("--kv-store", url, "--write-through")) for i in range(2)]
            started += spair
            for r in spair:
                r.wait()
            for name in stored:
                _flush_store(url)
                out["systems"][name] = _run_system(name, a, system, convs, reference, spair)
            out["restart"] = _restart_probe(a, system, convs, spair[0])
    finally:
        for r in started:
            r.stop()
        if server is not None:
            server.stop()
    sysd = out["systems"]
    ceil = sysd.get("ceiling", {}).get("hit_rate")
    rr = sysd.get("round-robin", {}).get("ttft_mean_ms_later_turns")
    for s in sysd.values():
        s["hit_rate_vs_ceiling"] = s["hit_rate"] / ceil if ceil else None
        later = s.get("ttft_mean_ms_later_turns")
        s["later_ttft_speedup_vs_round_robin"] = rr / later if rr and later else None
    out["restart_hit_ratio"] = out.get("restart", {}).get("ratio")
    out["logs"] = str(log_dir)
    rows = [[n, f"{s['hit_rate']:.1%}", f"{s['host_hit_rate']:.1%}", f"{s['store_hit_rate']:.1%}",
             f"{s['ttft_mean_ms']:.0f}", f"{s['ttft_p99_ms']:.0f}", f"{s['ttft_mean_ms_later_turns'] or 0:.0f}",
             f"{s['output_tokens_per_s']:.1f}", "/".join(str(c) for c in s["requests_by_replica"]),
             f"{s['load_imbalance']:.2f}", str(s["outputs_identical"])] for n, s in sysd.items()]
    table = format_table(["system", "hit", "host hit", "store hit", "TTFT mean ms", "p99 ms", "later-turn ms",
                          "out tok/s", "per replica", "imbalance", "identical"], rows)
    if "restart" in out:
        rs = out["restart"]
        table += (f"\nrestart: replica hit rate {rs['hit_rate_before']:.1%} before, {rs['hit_rate_after']:.1%} after "
                  f"(ratio {rs['ratio']:.2f}; {rs['store_blocks_after']} blocks from the store)")
    if a.plot:
        ttft_per_turn(a.plot, sysd, "TTFT per turn: two replicas, routing and the shared store")
    emit(table, out, a.json)
    return out
