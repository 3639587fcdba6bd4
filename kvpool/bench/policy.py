"""`kvpool bench policy`: eviction policies against the offline optimum, per trace and pool size.

For each trace, pool size and policy: the hit rate of a replay through the manager (the scheduler's
call pattern, `kvpool.bench.replay`), Belady's hit rate on the same pool (`kvpool.bench.belady`), the
fraction of the LRU-to-Belady gap the policy closes, and requests/s of the replay. Without `--trace`
it runs the standard traces: make_trace's multi-turn (concurrency 4) and shared-prefix (concurrency 4)
and the Mooncake FAST'25 synthetic trace (concurrency 16), converted from `../shared/peers/traces/`
when that folder is there. `--plot` draws hit rate against pool size, one line per policy plus Belady.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from kvpool.bench.belady import belady_hit_rate
from kvpool.bench.manager import check_host_eviction
from kvpool.bench.plots import hit_rate_vs_pool, plot_path
from kvpool.bench.replay import replay
from kvpool.bench.report import emit, format_table
from kvpool.bench.workloads import TraceRequest, load_trace, multi_turn_trace, shared_prefix_trace
from kvpool.core.eviction import policy_names
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager


@dataclass
class TraceCase:
    name: str
    trace: list[TraceRequest]
    num_blocks: list[int]
    concurrency: int


# The standard runs (the targets are stated at these sizes and concurrencies).
DEFAULTS = {"multi-turn": ([1024, 2048], 4), "shared-prefix": ([1024, 2048], 4),
            "mooncake": ([2048, 8192], 16)}


def shared_dir() -> Path:
    """`../shared` beside the project's checkout (worktrees included)."""
    return Path(__file__).resolve().parents[2].parent / "shared"


def mooncake_trace(block_size: int = 16) -> list[TraceRequest] | None:
    """The Mooncake synthetic trace, converted as `../shared/peers/mooncake_trace.py` converts it, or None
    where it is not here."""
    src = shared_dir() / "peers" / "traces" / "mooncake_synthetic_trace.jsonl"
    return load_trace(src, block_size) if src.exists() else None


def named_trace(name: str, block_size: int = 16) -> list[TraceRequest]:
    if name == "multi-turn":
        return multi_turn_trace()
    if name == "shared-prefix":
        return shared_prefix_trace()
    if name == "mooncake":
        t = mooncake_trace(block_size)
        if t is None:
            raise FileNotFoundError(f"mooncake: no trace under {shared_dir() / 'peers' / 'traces'}")
        return t
    return load_trace(name, block_size)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", action="append", default=None,
                   help="JSON-lines trace (make_trace's, or Mooncake's own format with hash_ids), or "
                   "multi-turn | shared-prefix | mooncake (repeatable); "
                        "default: those three")
    p.add_argument("--num-blocks", type=int, nargs="+", default=None,
                   help="pool sizes (default: multi-turn and shared-prefix 1024 2048; mooncake and files 2048 8192)")
    p.add_argument("--policies", default=",".join(policy_names()),
                   help=f"comma-separated, of {policy_names()} (default: all)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (default: 4 for multi-turn and shared-prefix, 16 otherwise)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hash-algo", default="sha256")
    p.add_argument("--host-blocks", type=int, default=0, help="a host tier of this many blocks behind the pool")
    p.add_argument("--host-eviction", default="lru",
                   help="the host tier's policy (lru, arc or any of --policies; needs --host-blocks)")
    p.add_argument("--no-belady", action="store_true", help="skip the offline-optimal simulation")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="hit rate vs pool size, one line per policy")


def cases(a: argparse.Namespace) -> list[TraceCase]:
    out = []
    names = a.trace or ["multi-turn", "shared-prefix", "mooncake"]
    # A file is named by its file name, or by its path where two files share one (their rows and plot
    # panels must not merge).
    short = [n if n in DEFAULTS else Path(n).name for n in names]
    for name, label in zip(names, short, strict=True):
        if a.trace is None and name == "mooncake" and not (
                shared_dir() / "peers" / "traces" / "mooncake_synthetic_trace.jsonl").exists():
            print(f"(mooncake skipped: no trace under {shared_dir()})", file=sys.stderr)
            continue
        sizes, conc = DEFAULTS.get(name, ([2048, 8192], 16))
        out.append(TraceCase(label if short.count(label) == 1 else name, named_trace(name, a.block_size),
                             a.num_blocks or sizes, conc if a.concurrency is None else a.concurrency))
    return out


def run(a: argparse.Namespace) -> dict:
    plot_path(a.plot)
    if a.concurrency is not None and a.concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {a.concurrency}")
    if a.num_blocks is not None and min(a.num_blocks) < 2:
        raise ValueError(f"num_blocks: every pool size must be >= 2, got {a.num_blocks}")
    if a.host_blocks < 0:
        raise ValueError(f"host_blocks: must be >= 0, got {a.host_blocks}")
    check_host_eviction(a)
    if a.block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {a.block_size}")
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    if not policies:
        raise ValueError(f"policies: name at least one of {policy_names()}")
    for p in policies:
        if p not in policy_names():
            raise ValueError(f"--policies: {p!r} is not one of {policy_names()}")
    results = []
    hasher = BlockHasher(a.block_size, a.hash_algo)
    for case in cases(a):
        for nb in case.num_blocks:
            optimal: float | None = None
            row_of: dict[str, dict] = {}
            for pol in policies:
                mgr = KVCacheManager(nb, a.block_size, eviction_policy=pol, num_host_blocks=a.host_blocks,
                                     host_eviction=a.host_eviction)
                r = replay(case.trace, mgr, hasher, case.concurrency)
                if optimal is None and not a.no_belady:
                    # With a host tier: its blocks and the device's as one pool, the most any two-tier policy
                    # hits; over the requests the replays ran (what they skip depends on the device pool only).
                    optimal = belady_hit_rate(case.trace, nb + a.host_blocks, a.block_size, case.concurrency,
                                              a.hash_algo, skip=r.skipped_indices)
                row_of[pol] = dict(trace=case.name, num_blocks=nb, concurrency=case.concurrency, policy=pol,
                                   host_blocks=a.host_blocks, hit_rate=r.hit_rate, belady_hit_rate=optimal,
                                   gap_closed=None, requests_per_s=(len(case.trace) - r.skipped) / r.wall_s,
                                   waited=r.waited, preempted=r.preempted, skipped=r.skipped)
            lru = row_of.get("lru", {}).get("hit_rate")
            for res in row_of.values():
                if lru is not None and optimal is not None and optimal > lru:
                    res["gap_closed"] = (res["hit_rate"] - lru) / (optimal - lru)
                results.append(res)
    rows = [[r["trace"], r["num_blocks"], r["concurrency"], r["policy"], round(r["hit_rate"], 4),
             "-" if r["belady_hit_rate"] is None else round(r["belady_hit_rate"], 4),
             "-" if r["gap_closed"] is None else f"{r['gap_closed']:+.0%}", round(r["requests_per_s"])]
            for r in results]
    table = format_table(["trace", "blocks", "conc", "policy", "hit rate", "Belady", "gap closed", "req/s"], rows)
    tight = [r for r in results if r["waited"] or r["preempted"] or r["skipped"]]
    if tight:
        each = "; ".join(f"{r['trace']} {r['num_blocks']} {r['policy']}: {r['waited']} waited, {r['preempted']} "
                         f"preempted, {r['skipped']} skipped" for r in tight)
        table += ("\nmore than the pool held at once (the replay waited, preempted the newest request, skipped "
                  "what never fits; Belady's MIN is then a strong heuristic, not a bound: what is cached decides "
                  f"when requests are admitted too): {each}")
    if a.host_blocks and not a.no_belady:
        table += f"\nBelady: the pool and the {a.host_blocks} host blocks as one pool (no two-tier policy hits more)"
    out = dict(system="kvpool", bench="policy", block_size=a.block_size, host_blocks=a.host_blocks,
               host_eviction=a.host_eviction, results=results)
    if a.plot:
        hit_rate_vs_pool(results, a.plot)
        table += f"\nplot: {a.plot}"
    emit(table, out, a.json)
    return out
