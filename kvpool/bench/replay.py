"""Replay a trace through a KV cache manager with the scheduler's call pattern, timing each operation.

Per request: create + hash the prompt, look up the cached prefix, allocate the prompt, then one
append + one-slot allocation per decoded token, then free. Up to `concurrency` requests are in flight
and each round every one of them decodes one token: the call pattern of `../shared/peers/vllm/
replay_trace.py`, so the two managers are timed on identical work.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.bench.workloads import TraceRequest
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.request import CacheRequest

OPS = ("hash_prompt", "lookup", "allocate_prefill", "decode_append", "decode_allocate", "free")


@dataclass
class ReplayResult:
    wall_s: float
    hit_tokens: int
    prompt_tokens: int
    times: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PoolTooSmall(ValueError):
    pass


def replay(trace: list[TraceRequest], manager: KVCacheManager, hasher: BlockHasher, concurrency: int,
           on_admit: Callable[[int], None] | None = None) -> ReplayResult:
    """Run the trace; `on_admit(i)` is told the index of each request before its lookup."""
    t = dict.fromkeys(OPS, 0.0)
    pc = time.perf_counter
    hit = prompt = 0
    gc.collect()
    wall0 = pc()
    active: list[list] = []
    i = 0
    n_trace = len(trace)
    while i < n_trace or active:
        while i < n_trace and len(active) < concurrency:
            tr = trace[i]
            if on_admit is not None:
                on_admit(i)
            i += 1
            t0 = pc()
            req = CacheRequest(tr["id"], tr["prompt"], hasher=hasher)
            t1 = pc()
            blocks, n_hit = manager.get_computed_blocks(req)
            t2 = pc()
            n = len(tr["prompt"])
            if manager.allocate_slots(req, n - n_hit, n_hit, blocks) is None:
                raise PoolTooSmall(f"{tr['id']}: prefill allocation failed: pool too small for this trace")
            t3 = pc()
            req.num_computed_tokens = n
            t["hash_prompt"] += t1 - t0
            t["lookup"] += t2 - t1
            t["allocate_prefill"] += t3 - t2
            hit += n_hit
            prompt += n
            active.append([req, tr["decode"], 0])
        still = []
        for st in active:
            req, dec, k = st
            if k < len(dec):
                t0 = pc()
                req.append_output_token_ids(dec[k])
                t1 = pc()
                if manager.allocate_slots(req, 1) is None:
                    raise PoolTooSmall(f"{req.request_id}: decode allocation failed: pool too small")
                t2 = pc()
                req.num_computed_tokens += 1
                st[2] = k + 1
                t["decode_append"] += t1 - t0
                t["decode_allocate"] += t2 - t1
            if st[2] >= len(dec):
                t0 = pc()
                manager.free(req)
                t["free"] += pc() - t0
            else:
                still.append(st)
        active = still
        manager.end_schedule_step()  # one scheduler step per round: the swap plan is handed out
    wall = pc() - wall0
    if manager.get_num_free_blocks() != manager.block_pool.num_usable_blocks:
        raise AssertionError("blocks leaked")
    return ReplayResult(wall_s=wall, hit_tokens=hit, prompt_tokens=prompt, times=t)
