"""The hit-density policy (`kvpool.core.lhd`): exact eviction orders on small pools."""

from __future__ import annotations

from helpers import run_request

from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.lhd import _N_AGE, LHDPolicy, _class
from kvpool.core.request import CacheRequest

BS = 4


def run(mgr: KVCacheManager, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    return run_request(mgr, rid, tokens, BS)


def bid(mgr: KVCacheManager, tokens: list[int], i: int) -> int:
    """The id of the block caching block `i` of `tokens`."""
    req = CacheRequest("probe", tokens, hasher=BlockHasher(BS))
    blk = mgr.block_pool.get_cached_block(req.block_hashes[i])
    assert blk is not None
    return blk.block_id


def test_without_statistics_it_is_lru_among_leaves() -> None:
    lru = KVCacheManager(9, BS, eviction_policy="lru")
    lhd = KVCacheManager(9, BS, eviction_policy="lhd")
    for mgr in (lru, lhd):
        run(mgr, "a", list(range(9)))  # blocks 1, 2 cached + 3 partial
        run(mgr, "b", list(range(100, 109)))
    assert lhd.block_pool.free_block_ids() == lru.block_pool.free_block_ids() == [5, 6, 7, 8, 2, 1, 4, 3]


def test_lineage_counts_the_extensions_of_a_prefix() -> None:
    mgr = KVCacheManager(16, BS, eviction_policy="lhd")
    pol = mgr.block_pool.policy
    assert isinstance(pol, LHDPolicy)
    t0 = list(range(9))
    run(mgr, "turn0", t0)
    t1 = t0[:8] + list(range(50, 59))
    _, hit = run(mgr, "turn1", t1)  # hits 2 blocks, caches 2 past them
    assert hit == 8
    assert [pol.lineage[bid(mgr, t1, i)] for i in range(4)] == [0, 0, 1, 1]
    t2 = t1[:16] + list(range(70, 79))
    _, hit = run(mgr, "turn2", t2)
    assert hit == 16
    ids = [bid(mgr, t2, i) for i in range(6)]
    assert [pol.lineage[i] for i in ids] == [0, 0, 1, 1, 2, 2]
    # The chain is classed by its deepest released lineage: every block of turn2's chain alike,
    # apart from its hit count (its first 2 blocks were hit twice, the next 2 once, the last 2 never).
    assert [pol.cls[i] for i in ids] == [_class(2, 2)] * 2 + [_class(1, 2)] * 2 + [_class(0, 2)] * 2


def test_a_class_that_is_hit_outlives_an_older_one_that_is_not() -> None:
    # Learned: a continued conversation (lineage 1, never hit yet) is hit soon after its release;
    # a new chain (lineage 0) is never hit. LRU would evict the older chain first (the conversation,
    # released first); LHD evicts the new chain, whose hit density is 0, and keeps the conversation.
    mgr = KVCacheManager(12, BS, eviction_policy="lhd")
    pol = mgr.block_pool.policy
    assert isinstance(pol, LHDPolicy)
    for a in range(4):
        pol.h_hit[_class(0, 1) * _N_AGE + a] += 10.0
        pol.h_evict[_class(0, 0) * _N_AGE + a] += 10.0
    pol._refresh()
    run(mgr, "c-t0", list(range(9)))
    t1 = list(range(8)) + list(range(50, 59))
    run(mgr, "c-t1", t1)  # 2 blocks hit + 2 new (lineage 1)
    x = list(range(100, 109))
    run(mgr, "x", x)  # a new chain, released last
    conv = [bid(mgr, t1, i) for i in range(4)]
    new = [bid(mgr, x, i) for i in range(2)]
    order = mgr.block_pool.free_block_ids()
    cached = [i for i in order if mgr.block_pool.blocks[i].block_hash is not None]
    # The new chain (tail first) goes before the conversation's chain, which goes tail first too.
    assert cached == [new[1], new[0], conv[3], conv[2], conv[1], conv[0]]
    # And the pool hands them out in that order.
    n_empty = len(order) - len(cached)
    taken = mgr.block_pool.get_new_blocks(n_empty + 2)
    assert [b.block_id for b in taken[n_empty:]] == [new[1], new[0]]
    mgr.block_pool.free_blocks(taken)
    lru = KVCacheManager(12, BS, eviction_policy="lru")
    run(lru, "c-t0", list(range(9)))
    run(lru, "c-t1", list(range(8)) + list(range(50, 59)))
    run(lru, "x", list(range(100, 109)))
    lru_cached = [i for i in lru.block_pool.free_block_ids() if lru.block_pool.blocks[i].block_hash is not None]
    assert lru_cached[:2] == [conv[3], conv[2]]  # LRU: the conversation first


def test_a_parent_is_never_evicted_before_its_free_child() -> None:
    # Densities that would rank the parent (hit class) below its child: only leaves are candidates.
    mgr = KVCacheManager(8, BS, eviction_policy="lhd")
    pol = mgr.block_pool.policy
    assert isinstance(pol, LHDPolicy)
    for a in range(_N_AGE):
        pol.h_evict[_class(1, 0) * _N_AGE + a] += 10.0  # hit once: never hit again
        pol.h_hit[_class(0, 1) * _N_AGE + a] += 10.0  # the branch past it: hit
    pol._refresh()
    run(mgr, "a", list(range(9)))
    t = [*range(8), 7, 7, 7, 7, 7]
    run(mgr, "a", t)  # blocks 0, 1 hit; a child under 1
    p1, p2 = bid(mgr, t, 0), bid(mgr, t, 1)
    order = [i for i in mgr.block_pool.free_block_ids() if mgr.block_pool.blocks[i].block_hash is not None]
    child = order[0]
    assert child not in (p1, p2) and order == [child, p2, p1]


def test_evictions_are_observed_past_the_eviction_window() -> None:
    mgr = KVCacheManager(6, BS, eviction_policy="lhd")
    pol = mgr.block_pool.policy
    assert isinstance(pol, LHDPolicy)
    pol.window = 100  # allocations (half a pool by default; this pool is tiny)
    run(mgr, "a", list(range(9)))  # caches 2 blocks
    run(mgr, "b", list(range(100, 117)))  # 5 blocks: evicts a's two
    assert len(pol.pending) == 2 and sum(pol.h_evict) == 0  # not counted yet: within the window
    _, hit = run(mgr, "a", list(range(9)))  # a's blocks computed again: the eviction cost hits
    assert hit == 0
    assert sum(pol.h_hit) == 2  # two hits at the age they came back
    # A returned block counts as reused (its hit count carries over the eviction).
    back = [b.block_id for b in mgr.block_pool.blocks if b.block_hash is not None and pol.hits[b.block_id]]
    assert len(back) == 2 and all(pol.hits[i] == 1 for i in back)
    # With a short window, an eviction that does not come back in time counts as an eviction.
    pol.window = 1
    run(mgr, "c", list(range(200, 217)))  # evicts a's two blocks again, and settles b's
    assert sum(pol.h_evict) > 0


def test_a_block_reused_from_the_low_queue_drops_the_count_of_its_former_children() -> None:
    """A parent with a free child is hit, slides out of a window (the low queue), is handed out for new
    content and cached as that former child's child. Its count of free children must start again at
    0: a stale one made the two wait for each other, neither a leaf, never listed nor evicted (the
    hypothesis machines found it on full + window + state groups)."""
    from kvpool.core.block import KVCacheBlock

    pol = LHDPolicy()
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    a.block_hash, b.block_hash = b"a", b"b"
    pol.on_cached(a, 0, None)
    pol.on_cached(b, 1, a)
    pol.append_n([b, a])  # released tail first: b counts as a's free child
    assert [x.block_id for x in pol] == [2, 1]
    pol.remove(a)  # a hit on the prefix alone
    pol.append_low_n([a])  # ... which then slid out of the request's window
    assert pol.popleft_n(1) == [a]  # the low queue goes first: a is handed out for new content
    a.block_hash = b"c"
    pol.on_cached(a, 2, b)  # now b's child
    pol.append_n([a])
    pol.check()
    assert pol.num_free_blocks == 2 and [x.block_id for x in pol] == [1, 2]
    assert pol.popleft_n(2) == [a, b]  # the new child first, then its parent
