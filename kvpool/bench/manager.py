"""`kvpool bench manager`: replay a trace through the KV cache manager alone (no model).

Reports hit rate, requests/s, blocks/s, microseconds per operation class (medians of `--repeats`
runs) and the offline-optimal (Belady) hit rate on the same pool, so the eviction policy's gap to the
optimum is visible. Its JSON line is what `../shared/peers/compare_manager.py` reads.
"""

from __future__ import annotations

import argparse
import statistics

from kvpool.bench.belady import belady_hit_rate, belady_note
from kvpool.bench.replay import OPS, replay
from kvpool.bench.report import emit, format_table
from kvpool.bench.workloads import load_trace, multi_turn_trace, shared_prefix_trace
from kvpool.core.eviction import policy_names
from kvpool.core.hashing import BlockHasher
from kvpool.core.host_pool import host_policy_names
from kvpool.core.kv_cache_manager import KVCacheManager

DEFAULT_REQUESTS = 2000


def check_host_eviction(a: argparse.Namespace) -> None:
    """--host-eviction orders the host tier: without one (--host-blocks 0) it would be ignored (the engine's
    config refuses the same)."""
    if a.host_eviction != "lru" and not a.host_blocks:
        raise ValueError(f"host_eviction: {a.host_eviction!r} orders the host tier, and there is none (set "
                         f"--host-blocks)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="JSON-lines trace; default: generate --workload")
    # (None: not given; with --trace neither is read, and multi-turn has its own size: refused there)
    p.add_argument("--workload", choices=["shared-prefix", "multi-turn"], default=None,
                   help="the trace to generate without --trace (default: shared-prefix)")
    p.add_argument("--requests", type=int, default=None,
                   help=f"shared-prefix requests when generating (default: {DEFAULT_REQUESTS})")
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hash-algo", default="sha256")
    p.add_argument("--host-blocks", type=int, default=0, help="a host tier of this many blocks behind the pool")
    p.add_argument("--host-eviction", default="lru", choices=host_policy_names(),
                   help="the host tier's policy (needs --host-blocks)")
    p.add_argument("--eviction-policy", default="lru", choices=policy_names(), help="the device tier's policy")
    p.add_argument("--no-belady", action="store_true", help="skip the offline-optimal simulation")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(a: argparse.Namespace) -> dict:
    for name in ("repeats", "concurrency", "block_size"):
        if getattr(a, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(a, name)}")
    if a.trace and (a.requests is not None or a.workload is not None):
        flag = "requests" if a.requests is not None else "workload"
        raise ValueError(f"{flag}: only read when generating a trace; --trace {a.trace} is replayed as it is")
    if a.workload == "multi-turn" and a.requests is not None:
        raise ValueError("requests: the size of the shared-prefix workload; --workload multi-turn has its own")
    requests = DEFAULT_REQUESTS if a.requests is None else a.requests
    if requests < 1:
        raise ValueError(f"requests: must be >= 1, got {requests}")
    if a.num_blocks < 2:
        raise ValueError(f"num_blocks: must be >= 2, got {a.num_blocks}")
    if a.host_blocks < 0:
        raise ValueError(f"host_blocks: must be >= 0, got {a.host_blocks}")
    check_host_eviction(a)
    if a.trace:
        trace, source = load_trace(a.trace, a.block_size), a.trace
    elif a.workload == "multi-turn":
        trace, source = multi_turn_trace(), "generated multi-turn"
    else:
        trace, source = shared_prefix_trace(requests), "generated shared-prefix"
    runs = []
    for _ in range(a.repeats):
        mgr = KVCacheManager(a.num_blocks, a.block_size, num_host_blocks=a.host_blocks,
                             host_eviction=a.host_eviction, eviction_policy=a.eviction_policy)
        runs.append(replay(trace, mgr, BlockHasher(a.block_size, a.hash_algo), a.concurrency))
    wall = statistics.median(r.wall_s for r in runs)
    r0 = runs[0]
    # The work done: the requests replayed and their blocks (a skipped request allocated none to the end).
    skipped = set(r0.skipped_indices)
    n_blocks = sum(-(-(len(r["prompt"]) + len(r["decode"])) // a.block_size)
                   for i, r in enumerate(trace) if i not in skipped)
    requests_per_s = (len(trace) - r0.skipped) / wall
    blocks_per_s = n_blocks / wall
    n_decode = sum(len(r["decode"]) for r in trace)
    per_op = {}
    for op in OPS:
        unit = n_decode if op.startswith("decode") else len(trace)
        per_op[op] = round(statistics.median(r.times[op] for r in runs) / max(unit, 1) * 1e6, 3)
    hit_rate = r0.hit_rate
    host_hit_rate = r0.host_hit_tokens / r0.prompt_tokens if r0.prompt_tokens else 0.0
    # (with a host tier: its blocks and the device's as one pool, the most any two-tier policy could hit)
    optimal = None if a.no_belady else belady_hit_rate(trace, a.num_blocks + a.host_blocks, a.block_size,
                                                      a.concurrency, a.hash_algo, skip=skipped)
    result = dict(system="kvpool", eviction_policy=a.eviction_policy, hash_algo=a.hash_algo, repeats=a.repeats,
                  requests=len(trace),
                  num_blocks=a.num_blocks, block_size=a.block_size, concurrency=a.concurrency,
                  hit_rate=hit_rate, belady_hit_rate=optimal, wall_s=wall, host_blocks=a.host_blocks,
                  host_hit_rate=host_hit_rate, blocks_swapped_out=mgr.swap_stats.blocks_out,
                  blocks_swapped_in=mgr.swap_stats.blocks_in,
                  requests_per_s=requests_per_s, blocks_per_s=blocks_per_s,
                  us_per_request_or_decode_token=per_op, waited=r0.waited, preempted=r0.preempted,
                  skipped=r0.skipped)
    n_req = (len(trace) if not (r0.waited or r0.preempted or r0.skipped) else
             f"{len(trace)} ({r0.waited} waited for room, {r0.preempted} preemptions, {r0.skipped} did not fit)")
    rows = [["trace", source], ["requests", n_req], ["pool", f"{a.num_blocks} blocks of {a.block_size}"],
            ["concurrency", a.concurrency], [f"hit rate ({a.eviction_policy.upper()})", f"{hit_rate:.4f}"],
            [f"hit rate (Belady optimum{belady_note(a.host_blocks, r0)})",
             "skipped" if optimal is None else f"{optimal:.4f}"],
            ["host tier", f"{a.host_blocks} blocks ({a.host_eviction}): hit rate {host_hit_rate:.4f}, "
                          f"{mgr.swap_stats.blocks_out} blocks out, {mgr.swap_stats.blocks_in} in"],
            ["wall s (median)", f"{wall:.3f}"], ["requests/s", f"{requests_per_s:,.0f}"],
            ["blocks/s", f"{blocks_per_s:,.0f}"]]
    rows += [[f"us per {'decoded token' if op.startswith('decode') else 'request'}: {op}", per_op[op]]
             for op in OPS]
    emit(format_table(["metric", "value"], rows), result, a.json)
    return result
