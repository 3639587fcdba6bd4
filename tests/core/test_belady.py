"""The offline-optimal reference (`kvpool.bench.belady`): no online policy may beat it on a trace the pool
holds as the replay runs it, whatever the concurrency (two turns of one conversation in flight together
compute the same blocks twice), and a prompt the pool can never hold takes no part in it."""

from __future__ import annotations

import random

import pytest

from kvpool.bench.belady import belady_hit_rate
from kvpool.bench.replay import replay
from kvpool.bench.workloads import TraceRequest
from kvpool.core.eviction import policy_names
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager

BS = 4


def conversations(n: int, turns: int, seed: int) -> list[TraceRequest]:
    """Chats over one system prompt, their turns interleaved at random: each prompt is its chat so far."""
    rng = random.Random(seed)
    system = [rng.randrange(1000) for _ in range(8)]
    history = [list(system) for _ in range(n)]
    order = [c for c in range(n) for _ in range(turns)]
    rng.shuffle(order)
    trace: list[TraceRequest] = []
    for k, c in enumerate(order):
        history[c] += [rng.randrange(1000) for _ in range(rng.randint(1, 10))]
        answer = [rng.randrange(1000) for _ in range(rng.randint(1, 8))]
        trace.append({"id": f"c{c}-{k}", "prompt": list(history[c]), "decode": answer})
        history[c] += answer
    return trace


@pytest.fixture(autouse=True)
def _no_gc_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # The replay collects garbage before timing; here nothing is timed, and a pass over the test process's
    # heap costs more than a tiny replay.
    monkeypatch.setattr("kvpool.bench.replay.gc.collect", lambda: 0)


@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_no_policy_beats_the_optimum_on_a_trace_the_pool_holds(concurrency: int) -> None:
    checked = 0
    for seed in range(1, 120, 2):
        rng = random.Random(seed)
        trace = conversations(rng.randint(3, 6), rng.randint(2, 5), seed)
        for num_blocks in (12, 16, 24, 40):
            runs = {p: replay(trace, KVCacheManager(num_blocks, BS, eviction_policy=p), BlockHasher(BS), concurrency)
                    for p in policy_names()}
            if any(r.waited or r.preempted or r.skipped for r in runs.values()):
                continue  # (then MIN is a heuristic, not a bound: admission depends on what is cached)
            optimum = belady_hit_rate(trace, num_blocks, BS, concurrency)
            best = max(runs, key=lambda p: runs[p].hit_rate)
            assert runs[best].hit_rate <= optimum + 1e-12, (seed, num_blocks, best, runs[best].hit_rate, optimum)
            checked += 1
    assert checked >= 50


def test_a_prompt_the_pool_never_holds_is_no_future_use() -> None:
    """The replay skips it, so its lookups never happen: counting them as uses kept blocks for nothing, and
    LRU came out above the "optimum" (later turns of a chat outgrow an 8-block pool)."""
    trace = conversations(3, 5, 31)
    lru = replay(trace, KVCacheManager(8, BS), BlockHasher(BS), 1)
    assert lru.skipped > 0 and not lru.waited and not lru.preempted
    assert belady_hit_rate(trace, 8, BS, 1) >= lru.hit_rate
