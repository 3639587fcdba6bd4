"""The regret-weighted mixture of `reuse` and `lhd` (`kvpool.core.adaptive`): who evicts, what both
experts learn from it, and how a ghost hit moves the weights."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from kvpool.bench.replay import replay
from kvpool.bench.workloads import TraceRequest, multi_turn_trace, shared_prefix_trace
from kvpool.core.adaptive import AdaptivePolicy
from kvpool.core.block import KVCacheBlock
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager


def chains() -> tuple[AdaptivePolicy, list[KVCacheBlock]]:
    """Two released chains of two blocks, a1 <- a2 and b1 <- b2 (ids 1-4), released tail first."""
    pol = AdaptivePolicy()
    a1, a2, b1, b2 = (KVCacheBlock(i) for i in range(1, 5))
    for blk, name in ((a1, b"a1"), (a2, b"a2"), (b1, b"b1"), (b2, b"b2")):
        blk.block_hash = name
    pol.on_cached(a1, 0, None)
    pol.on_cached(a2, 1, a1)
    pol.append_n([a2, a1])
    pol.on_cached(b1, 0, None)
    pol.on_cached(b2, 1, b1)
    pol.append_n([b2, b1])
    pol.check()
    return pol, [a1, a2, b1, b2]


def test_the_drawn_expert_evicts_and_the_other_learns_of_it() -> None:
    pol, (a1, a2, b1, b2) = chains()
    assert pol.num_free_blocks == 4
    pol.weights = [1.0, 0.0]  # reuse draws every eviction
    assert pol.popleft_n(1) == [a2]  # equal values: GreedyDual is LRU, the first released first
    pol.check()  # gone from lhd too ...
    assert b"a2" in pol.lhd.pending and b"a2" in pol.lhd.ghosts  # ... which observes it as its own eviction
    assert pol.ghosts[b"a2"] == (0, 0) and pol.evictions_by == [1, 0]
    pol.weights = [0.0, 1.0]  # lhd draws: a1 is a leaf now, released before b2
    assert pol.popleft_n(1) == [a1]
    pol.check()
    assert [b.block_id for b in pol.reuse] == [b2.block_id, b1.block_id]
    assert pol.ghosts[b"a1"] == (1, 1) and pol.evictions_by == [1, 1] and pol.num_free_blocks == 2


def test_a_ghost_hit_lowers_the_weight_of_the_expert_that_evicted_it() -> None:
    pol, (a1, a2, _b1, _b2) = chains()
    pol.weights = [1.0, 0.0]
    pol.popleft_n(1)  # reuse evicts a2 at time 0
    pol.weights = [0.5, 0.5]
    a2.block_hash = b"a2"  # the same content computed again, one allocation later
    pol.on_cached(a2, 1, a1)
    w = 0.5 * math.exp(-AdaptivePolicy.LEARNING_RATE * AdaptivePolicy.DISCOUNT_PER_POOL ** (1 / pol.size))
    assert pol.weights == pytest.approx([w / (w + 0.5), 0.5 / (w + 0.5)])
    assert pol.regrets == [1, 0] and b"a2" not in pol.ghosts
    pol.on_cached(a2, 1, a1)  # (no ghost any more: no second regret)
    assert pol.regrets == [1, 0]


def test_weights_stay_within_the_floor() -> None:
    pol, (a1, a2, _b1, _b2) = chains()
    for _ in range(60):  # reuse wrong again and again
        pol.ghosts[b"a2"] = (0, pol.now)
        pol.on_cached(a2, 1, a1)
    assert pol.weights == pytest.approx([AdaptivePolicy.MIN_WEIGHT, 1 - AdaptivePolicy.MIN_WEIGHT])


def test_empty_and_low_blocks_are_kept_here_and_go_first() -> None:
    pol, (a1, _a2, _b1, _b2) = chains()
    e, low = KVCacheBlock(5), KVCacheBlock(6)
    low.block_hash = b"low"
    pol.prepend_n([e])
    pol.append_low_n([low])
    assert [b.block_id for b in pol][:2] == [5, 6] and pol.num_free_blocks == 6
    assert pol.reuse.num_free_blocks == pol.lhd.num_free_blocks == 4  # the experts hold cached blocks only
    pol.remove(low)  # a hit on the low-value block
    assert pol.popleft_n(1) == [e] and pol.lhd.now == 1  # lhd's clock counts every block handed out
    assert pol.evictions_by == [0, 0] and not pol.ghosts
    pol.remove(a1)  # a hit on a cached block leaves both experts
    pol.check()
    with pytest.raises(ValueError, match="is not free"):
        pol.remove(a1)


@pytest.mark.parametrize(("trace", "better"), [(multi_turn_trace, 1), (lambda: shared_prefix_trace(500), 0)])
def test_the_weights_follow_the_expert_that_suits_the_traffic(trace: Callable[[], list[TraceRequest]],
                                                              better: int) -> None:
    """On make_trace's multi-turn shape lhd wins (conversations return soon after release), on the
    shared-prefix shape reuse does (many one-off suffixes after a few reused prompts); the weights
    end on that expert, and a replay is reproducible (a seeded draw)."""
    results = []
    for _ in range(2):
        mgr = KVCacheManager(num_blocks=1024, block_size=16, eviction_policy="adaptive")
        r = replay(trace(), mgr, BlockHasher(16), 4)
        mgr.check_integrity()
        pol = mgr.block_pool.policy
        assert isinstance(pol, AdaptivePolicy)
        assert pol.weights[better] > 0.9
        results.append((r.hit_rate, pol.weights, pol.evictions_by))
    assert results[0] == results[1]
