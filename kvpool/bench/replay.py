"""Replay a trace through a KV cache manager with the scheduler's call pattern, timing each operation.

Per request: create + hash the prompt, look up the cached prefix, allocate the prompt, then one
append + one-slot allocation per decoded token, then free. Up to `concurrency` requests are in flight
and each round every one of them decodes one token: the call pattern of `../shared/peers/vllm/
replay_trace.py`, so the two managers are timed on identical work.

A trace from production may ask for more than the pool holds at once (a few long prompts in flight
together), which vLLM's replay script does not survive. Here the replay does what a scheduler does,
and only then: a prompt that does not fit waits for requests in flight to finish (`waited`); when a decode
step does not fit, the newest request in flight is preempted (its blocks released, cached, and it
resumes later from its prompt plus what it had generated, first in line); a request that does not
fit an otherwise empty pool is skipped, and is not in the hit rate (neither is one skipped mid-answer,
its prompt's lookup taken back). A resumed request's lookup is not counted (its prompt was counted
once, at its first admission); `preempted` and `skipped` say how often either happened. On a trace
that fits, none of this runs and the call pattern is exactly the one above.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    host_hit_tokens: int = 0  # of the hits, tokens found in the host tier
    waited: int = 0  # requests whose prompt did not fit at first: admitted once others finished
    preempted: int = 0  # decode steps that did not fit: requests preempted to make room
    skipped: int = 0  # requests that did not fit the empty pool (not in the hit rate)
    skipped_indices: list[int] = field(default_factory=list)  # which (indices into the trace)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PoolTooSmall(ValueError):
    pass


def _make_room(manager: KVCacheManager, active: list[list[Any]], st: list[Any],
               resume: deque[tuple[int, list[int], list[int]]]) -> tuple[bool, int]:
    """Recompute preemption, newest first, until `st`'s decode slot fits: (whether it fits, how many were
    preempted). A victim resumes later from its prompt plus what it had generated."""
    n = 0
    while active[-1] is not st:
        _preempt(manager, active.pop(), resume)
        n += 1
        if manager.allocate_slots(st[0], 1) is not None:
            return True, n
    return False, n


def _preempt(manager: KVCacheManager, victim: list[Any], resume: deque[tuple[int, list[int], list[int]]]) -> None:
    """Free a running request's blocks (cached: it will hit them) and put it first in line to resume from
    what it has computed, its remaining decode tokens after."""
    req = victim[0]
    manager.free(req, preempted=True)
    resume.appendleft((victim[3], list(req.all_token_ids[:req.num_computed_tokens]), victim[1][victim[2]:]))


def replay(trace: list[TraceRequest], manager: KVCacheManager, hasher: BlockHasher, concurrency: int,
           on_admit: Callable[[int], None] | None = None) -> ReplayResult:
    """Run the trace; `on_admit(i)` is told the index of each request before its lookup (again when a
    preempted request resumes)."""
    t = dict.fromkeys(OPS, 0.0)
    pc = time.perf_counter
    hit = prompt = host_hit = waited = preempted = skipped = 0
    skipped_indices: list[int] = []
    counted: dict[int, tuple[int, int, int]] = {}  # trace index -> (prompt, hit, host hit) tokens counted
    last_waiting = -1
    gc.collect()
    wall0 = pc()
    active: list[list[Any]] = []  # [request, decode tokens, how many appended, trace index]
    # Preempted requests, resumed before the next new one: (trace index, tokens so far, decode left).
    resume: deque[tuple[int, list[int], list[int]]] = deque()
    i = 0
    n_trace = len(trace)
    while i < n_trace or active or resume:
        while (resume or i < n_trace) and len(active) < concurrency:
            first = not resume
            if first:
                idx = i
                tokens, dec = trace[i]["prompt"], trace[i]["decode"]
            else:
                idx, tokens, dec = resume[0]
            if on_admit is not None:
                on_admit(idx)
            t0 = pc()
            req = CacheRequest(trace[idx]["id"], tokens, hasher=hasher)
            t1 = pc()
            blocks, n_hit = manager.get_computed_blocks(req)
            t2 = pc()
            n = len(tokens)
            ok = manager.allocate_slots(req, n - n_hit, n_hit, blocks) is not None
            t3 = pc()
            t["hash_prompt"] += t1 - t0
            t["lookup"] += t2 - t1
            t["allocate_prefill"] += t3 - t2
            if not ok and active:
                if first and last_waiting != idx:
                    waited += 1
                    last_waiting = idx
                break  # wait for the requests in flight to make room
            if first:
                i += 1
            else:
                resume.popleft()
            if not ok:
                skipped += 1  # does not fit the pool even alone
                skipped_indices.append(idx)
                continue
            req.num_computed_tokens = n
            if first:
                n_host = blocks.num_host_positions() * manager.block_size if manager.host is not None else 0
                hit += n_hit
                prompt += n
                host_hit += n_host
                counted[idx] = (n, n_hit, n_host)
            active.append([req, dec, 0, idx])
        still = []
        for st in active:  # (a preemption cuts requests from the end of `active`: not visited after)
            req, dec, k = st[0], st[1], st[2]
            if k < len(dec):
                t0 = pc()
                req.append_output_token_ids(dec[k])
                t1 = pc()
                if manager.allocate_slots(req, 1) is None:
                    ok, n = _make_room(manager, active, st, resume)
                    preempted += n
                    if not ok:
                        if still:  # older requests hold the rest: this one waits for them, preempted too
                            _preempt(manager, st, resume)
                            preempted += 1
                        else:  # alone in the pool and still no room: it never fits
                            manager.free(req)
                            skipped += 1
                            skipped_indices.append(st[3])
                            n, n_hit, n_host = counted.pop(st[3], (0, 0, 0))
                            prompt, hit, host_hit = prompt - n, hit - n_hit, host_hit - n_host
                        continue
                t2 = pc()
                t["decode_append"] += t1 - t0
                t["decode_allocate"] += t2 - t1
                req.num_computed_tokens += 1
                st[2] = k = k + 1
            if k >= len(dec):
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
    if n_trace and skipped == n_trace:
        raise PoolTooSmall(f"no request of the trace fits a pool of {manager.block_pool.num_usable_blocks} blocks")
    return ReplayResult(wall_s=wall, hit_tokens=hit, prompt_tokens=prompt, times=t, host_hit_tokens=host_hit,
                        waited=waited, preempted=preempted, skipped=skipped, skipped_indices=skipped_indices)
