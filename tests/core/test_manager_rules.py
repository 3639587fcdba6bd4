"""The manager's rules, one by one, with exact block ids and ref counts."""

from __future__ import annotations

import pytest
from helpers import decode, make_request, schedule, snapshot

from kvpool.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.core.kv_cache_manager import KVCacheManager


def test_hit_never_covers_the_whole_prompt() -> None:
    bs = 4
    mgr = KVCacheManager(10, bs)
    a = make_request("a", list(range(8)), bs)
    schedule(mgr, a)
    mgr.free(a)
    same = make_request("b", list(range(8)), bs)
    hit, n = mgr.get_computed_blocks(same)
    # Both blocks are cached, but the last token must be recomputed: only the first block is a hit.
    assert n == 4 and hit.get_block_ids() == ([1],)
    longer = make_request("c", list(range(9)), bs)
    hit, n = mgr.get_computed_blocks(longer)
    assert n == 8 and hit.get_block_ids() == ([1, 2],)


def test_lookup_changes_no_block_state() -> None:
    bs = 4
    mgr = KVCacheManager(10, bs)
    a = make_request("a", list(range(12)), bs)
    schedule(mgr, a)
    mgr.free(a)
    before = snapshot(mgr)
    _, n = mgr.get_computed_blocks(make_request("b", list(range(13)), bs))
    assert n == 12
    assert snapshot(mgr) == before


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    bs = 4
    mgr = KVCacheManager(6, bs)  # 5 usable blocks
    a = make_request("a", list(range(12)), bs)
    schedule(mgr, a)
    mgr.free(a)  # 3 cached free blocks, 2 never used
    b = make_request("b", [*range(8), *range(100, 120)], bs)  # hits 2 blocks, needs 5 more
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8
    before = snapshot(mgr)
    # 5 new blocks + 2 hits that sit in the free queue = 7 > 5 free.
    assert mgr.allocate_slots(b, b.num_tokens - n, n, hit) is None
    assert snapshot(mgr) == before
    mgr.check_integrity()
    # A decode that does not fit changes nothing either.
    c = make_request("c", list(range(200, 220)), bs)
    assert schedule(mgr, c) is not None  # all 5 blocks
    before = snapshot(mgr)
    c.append_output_token_ids(1)
    assert mgr.allocate_slots(c, 1) is None
    assert snapshot(mgr) == before


def test_hits_on_free_blocks_count_against_free_space() -> None:
    bs = 4
    mgr = KVCacheManager(6, bs)
    a = make_request("a", list(range(12)), bs)
    schedule(mgr, a)
    mgr.free(a)
    b = make_request("b", [*range(8), 50, 51, 52, 53, 54], bs)  # 2 hits + 2 new = 4 <= 5
    assert schedule(mgr, b) is not None
    assert mgr.get_block_ids("b") == ([1, 2, 4, 5],)
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [1, 1, 0, 1, 1]
    assert mgr.block_pool.free_block_ids() == [3]


def test_blocks_full_at_allocation_are_cached_for_the_same_step() -> None:
    bs = 4
    mgr = KVCacheManager(10, bs)
    a = make_request("a", list(range(9)), bs)
    schedule(mgr, a)  # not yet computed: the forward of this step will write them
    b = make_request("b", list(range(10)), bs)
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8 and hit.get_block_ids() == ([1, 2],)
    schedule(mgr, b)
    assert mgr.block_pool.blocks[1].ref_cnt == 2 and mgr.block_pool.blocks[2].ref_cnt == 2


def test_chunked_prefill_caches_as_chunks_complete() -> None:
    bs = 4
    mgr = KVCacheManager(10, bs)
    a = make_request("a", list(range(14)), bs)
    assert mgr.allocate_slots(a, 6).get_block_ids() == ([1, 2],)
    a.num_computed_tokens = 6
    assert len(mgr.block_pool.cached) == 1  # only the first block is full after 6 tokens
    assert mgr.allocate_slots(a, 6).get_block_ids() == ([3],)
    a.num_computed_tokens = 12
    assert len(mgr.block_pool.cached) == 3
    assert mgr.allocate_slots(a, 2).get_block_ids() == ([4],)
    a.num_computed_tokens = 14
    assert len(mgr.block_pool.cached) == 3
    mgr.check_integrity()


def test_freed_uncached_block_is_reused_before_cached_ones() -> None:
    bs = 4
    mgr = KVCacheManager(5, bs)  # 4 usable
    a = make_request("a", list(range(10)), bs)  # 2 full + 1 partial
    schedule(mgr, a)
    mgr.free(a)
    assert mgr.block_pool.free_block_ids() == [3, 4, 2, 1]
    b = make_request("b", [77], bs)
    schedule(mgr, b)
    assert mgr.get_block_ids("b") == ([3],)
    assert len(mgr.block_pool.cached) == 2


def test_lru_among_cached_blocks() -> None:
    bs = 4
    mgr = KVCacheManager(7, bs)  # 6 usable
    a = make_request("a", list(range(8)), bs)
    b = make_request("b", list(range(100, 108)), bs)
    schedule(mgr, a)
    schedule(mgr, b)
    mgr.free(a)
    mgr.free(b)
    assert mgr.block_pool.free_block_ids() == [5, 6, 2, 1, 4, 3]
    # A hit on a's blocks makes them most recently used once freed again.
    a2 = make_request("a2", [*range(8), 9], bs)
    schedule(mgr, a2)
    mgr.free(a2)
    # a2's partial block (5) holds nothing: it goes to the head; a's blocks go behind b's.
    assert mgr.block_pool.free_block_ids() == [5, 6, 4, 3, 2, 1]
    big = make_request("big", list(range(300, 300 + 16)), bs)
    schedule(mgr, big)  # 4 blocks: the two empty ones, then b's (least recently used)
    assert mgr.get_block_ids("big") == ([5, 6, 4, 3],)
    hit, n = mgr.get_computed_blocks(make_request("q", list(range(100, 109)), bs))
    assert n == 0
    hit, n = mgr.get_computed_blocks(make_request("q2", list(range(9)), bs))
    assert hit.get_block_ids() == ([1, 2],)


def test_lookahead_slots_allocate_blocks_but_are_not_cached() -> None:
    bs = 4
    mgr = KVCacheManager(10, bs)
    a = make_request("a", list(range(4)), bs)
    new = mgr.allocate_slots(a, 4, num_lookahead_tokens=5)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert len(mgr.block_pool.cached) == 1


def test_free_releases_tail_first_and_ref_counts_never_go_negative() -> None:
    bs = 4
    mgr = KVCacheManager(10, bs)
    a = make_request("a", list(range(12)), bs)
    schedule(mgr, a)
    mgr.free(a)
    mgr.free(a)  # a second free of the same request is a no-op, not a double free
    assert [b.ref_cnt for b in mgr.block_pool.blocks[1:]] == [0] * 9
    mgr.check_integrity()


def test_a_preemption_by_request_id_is_refused() -> None:
    """The preempted mark lives on the request (its next admission is counted apart); given only its id,
    `free(..., preempted=True)` dropped the mark silently and the resumed admission counted as a new request."""
    mgr = KVCacheManager(10, 4)
    a = make_request("a", list(range(12)), 4)
    schedule(mgr, a)
    with pytest.raises(ValueError, match=r"^free: preempted=True needs the request itself, not its id"):
        mgr.free("a", preempted=True)
    assert mgr.get_block_ids("a") == ([1, 2, 3],)  # nothing was freed
    mgr.free("a")
    mgr.check_integrity()


def test_prefix_caching_off() -> None:
    bs = 4
    mgr = KVCacheManager(10, bs, enable_caching=False)
    a = make_request("a", list(range(12)), bs)
    schedule(mgr, a)
    assert not mgr.block_pool.cached
    mgr.free(a)
    hit, n = mgr.get_computed_blocks(make_request("b", list(range(13)), bs))
    assert n == 0 and hit.get_block_ids() == ([],)
    assert mgr.stats.queries == 0
    mgr.check_integrity()


def test_stats_count_a_request_once_when_admitted_not_each_lookup_while_it_waits() -> None:
    """A request that does not fit waits at the head of the queue and is looked up again every step; the
    hit rate counts it once, when its allocation goes ahead (with the hit it was admitted with)."""
    bs = 4
    mgr = KVCacheManager(6, bs)
    a = make_request("a", list(range(12)), bs)
    schedule(mgr, a)  # 3 blocks, no hit
    mgr.free(a)
    hog = make_request("hog", list(range(100, 112)), bs)
    assert schedule(mgr, hog) is not None  # the 3 empty blocks: a's 3 stay cached
    b = make_request("b", [*range(8), 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60], bs)
    for _ in range(3):  # b hits a's first 2 blocks and needs 3 more, with 1 to spare: it waits
        assert schedule(mgr, b) is None
    assert (mgr.stats.requests, mgr.stats.queries, mgr.stats.hits) == (2, 24, 0)
    mgr.free(hog)
    assert schedule(mgr, b) is not None
    assert (mgr.stats.requests, mgr.stats.queries, mgr.stats.hits) == (3, 24 + 19, 8)
    assert mgr.take_prefix_cache_stats().requests == 3
    mgr.check_integrity()


def test_stats_usage_and_reset() -> None:
    bs = 4
    mgr = KVCacheManager(11, bs)
    a = make_request("a", list(range(12)), bs)
    schedule(mgr, a)
    assert mgr.usage == pytest.approx(0.3)
    assert mgr.reset_prefix_cache() is False  # refused while blocks are in use
    mgr.free(a)
    assert mgr.usage == 0.0
    b = make_request("b", list(range(13)), bs)
    schedule(mgr, b)
    assert (mgr.stats.queries, mgr.stats.hits) == (25, 12)
    assert mgr.stats.hit_rate == pytest.approx(12 / 25)
    interval = mgr.take_prefix_cache_stats()
    assert interval.hits == 12 and mgr.take_prefix_cache_stats().hits == 0
    mgr.free(b)
    assert mgr.reset_prefix_cache() is True
    assert not mgr.block_pool.cached
    assert all(blk.block_hash is None for blk in mgr.block_pool.blocks)
    _, n = mgr.get_computed_blocks(make_request("c", list(range(13)), bs))
    assert n == 0
    mgr.check_integrity()


def test_kv_events() -> None:
    bs = 4
    mgr = KVCacheManager(4, bs, enable_kv_events=True)  # 3 usable
    a = make_request("a", list(range(9)), bs, lora_id=7)
    schedule(mgr, a)
    ev = mgr.take_events()
    # vLLM's shape: one BlockStored for the allocation, every newly cached hash in chain order.
    assert [type(e) for e in ev] == [BlockStored]
    assert ev[0].block_hashes == a.block_hashes[:2] and ev[0].parent_block_hash is None
    assert ev[0].token_ids == list(range(8)) and ev[0].block_size == 4 and ev[0].medium == "GPU"
    assert ev[0].lora_id == 7 and ev[0].extra_keys == [(("lora", 7),), (("lora", 7),)]
    assert mgr.take_events() == []
    mgr.free(a)
    b = make_request("b", list(range(50, 62)), bs)
    schedule(mgr, b)  # reuses the partial block first, then evicts a's tail, then a's head
    ev = mgr.take_events()
    removed = [e.block_hashes[0] for e in ev if isinstance(e, BlockRemoved)]
    assert removed == [a.block_hashes[1], a.block_hashes[0]]
    mgr.free(b)
    assert mgr.reset_prefix_cache()
    assert isinstance(mgr.take_events()[-1], AllBlocksCleared)


def test_kv_events_report_duplicates_and_the_parent_of_a_continuation() -> None:
    bs = 4
    mgr = KVCacheManager(10, bs, enable_kv_events=True)
    a, b = make_request("a", list(range(8)), bs), make_request("b", list(range(8)), bs)
    # Both admitted before either computed a block: b finds no hit and caches a second copy.
    assert mgr.allocate_slots(a, 8) is not None and mgr.allocate_slots(b, 8) is not None
    ev = mgr.take_events()
    assert [e.block_hashes for e in ev] == [a.block_hashes[:2], a.block_hashes[:2]]
    # A decode that fills the next block: the parent is the last block cached before.
    a.num_computed_tokens = 8
    for t in (1, 2, 3, 4):
        a.append_output_token_ids(t)
        assert mgr.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    (e,) = mgr.take_events()
    assert e.block_hashes == [a.block_hashes[2]] and e.parent_block_hash == a.block_hashes[1]
    assert e.token_ids == [1, 2, 3, 4]
    mgr.free(a)
    mgr.free(b)
    # Evicting everything removes each copy with its own event, as vLLM reports them.
    big = make_request("c", list(range(100, 136)), bs)
    assert mgr.allocate_slots(big, 36) is not None
    removed = [e.block_hashes[0] for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(removed) == sorted([*a.block_hashes[:3], *a.block_hashes[:2]])


def test_preempted_request_rehits_its_own_blocks() -> None:
    bs = 4
    mgr = KVCacheManager(10, bs)
    a = make_request("a", list(range(10)), bs)
    schedule(mgr, a)
    for t in (1, 2, 3):
        decode(mgr, a, t)
    mgr.free(a)  # preemption by recompute
    a.num_computed_tokens = 0
    hit, n = mgr.get_computed_blocks(a)
    assert n == 12 and hit.get_block_ids() == ([1, 2, 3],)
    assert mgr.allocate_slots(a, a.num_tokens - n, n, hit).get_block_ids() == ([4],)


def test_bad_arguments_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(10, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(1, 4)
    mgr = KVCacheManager(10, 4)
    with pytest.raises(ValueError, match="token counts"):
        mgr.allocate_slots(make_request("a", [1, 2], 4), -1)


def test_blocks_freed_without_cached_content_go_to_the_front_in_the_order_given() -> None:
    # vLLM's order: a request's blocks are freed tail first, and those holding nothing cached go to the
    # front as one batch in that order, so the tail is reused first.
    bs = 4
    mgr = KVCacheManager(5, bs, enable_caching=False)
    a = make_request("a", list(range(10)), bs)
    assert mgr.allocate_slots(a, 10).get_block_ids() == ([1, 2, 3],)
    mgr.free(a)
    assert mgr.block_pool.free_block_ids() == [3, 2, 1, 4]
    mgr.check_integrity()


def test_free_order_with_caching_and_lookahead_slots() -> None:
    bs = 4
    mgr = KVCacheManager(6, bs)
    a = make_request("a", list(range(10)), bs)
    # 10 tokens + 3 lookahead slots: 4 blocks, the first 2 full and cached, the last 2 empty.
    assert mgr.allocate_slots(a, 10, num_lookahead_tokens=3).get_block_ids() == ([1, 2, 3, 4],)
    mgr.free(a)
    # Empty blocks first (tail first, as freed), then the never-used one, then the cached chain, tail first.
    assert mgr.block_pool.free_block_ids() == [4, 3, 5, 2, 1]
    mgr.check_integrity()
