"""The host tier: shelter on eviction, lookups that continue into it, swap plans, LRU and ARC order."""

from __future__ import annotations

import pytest
from helpers import make_request, schedule, snapshot

from kvpool.core.events import BlockStored
from kvpool.core.hashing import BlockHasher
from kvpool.core.host_pool import HostBlockPool
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import SlidingWindowSpec
from kvpool.core.request import CacheRequest, MultiModalItem

BS = 4


def fill_and_evict(mgr: KVCacheManager) -> tuple:
    a = make_request("a", list(range(12)), BS)
    schedule(mgr, a)
    assert not mgr.end_schedule_step()
    mgr.free(a)
    b = make_request("b", list(range(100, 116)), BS)
    schedule(mgr, b)  # 4 blocks: the 2 empty ones, then a's tail (3) and a's middle (2)
    plan = mgr.end_schedule_step()
    mgr.free(b)
    return a, plan


def test_evicted_cached_blocks_are_sheltered_in_the_host_tier() -> None:
    mgr = KVCacheManager(6, BS, num_host_blocks=4)
    a, plan = fill_and_evict(mgr)
    assert mgr.get_block_ids("b") == ([],)
    assert plan.swap_out == [(3, 0), (2, 1)] and plan.swap_in == []
    assert mgr.host_pool.cached[a.block_hashes[2]].block_id == 0
    assert mgr.host_pool.cached[a.block_hashes[1]].block_id == 1
    assert mgr.swap_stats.blocks_out == 2
    mgr.check_integrity()


def test_sheltering_an_evicted_block_publishes_its_host_copy() -> None:
    # The eviction listener runs after the device block gave up its hash: the event must still name it
    # (this once failed an assertion and stopped a replica serving with KV events and a host tier).
    mgr = KVCacheManager(6, BS, num_host_blocks=4, enable_kv_events=True)
    a, plan = fill_and_evict(mgr)
    assert plan.swap_out == [(3, 0), (2, 1)]
    events = mgr.take_events()
    host_stored = [e for e in events if type(e).__name__ == "BlockStored" and e.medium == HostBlockPool.medium]
    assert [e.block_hashes for e in host_stored] == [[a.block_hashes[2]], [a.block_hashes[1]]]
    assert [list(e.token_ids) for e in host_stored] == [list(range(8, 12)), list(range(4, 8))]
    assert host_stored[1].parent_block_hash == a.block_hashes[0]
    mgr.check_integrity()


def test_a_host_copy_is_published_with_the_lora_and_extra_keys_of_its_device_block() -> None:
    """A consumer indexing blocks by (tokens, LoRA, extra keys) must read the host copy as the block it is."""
    mgr = KVCacheManager(4, BS, num_host_blocks=4, enable_kv_events=True)
    a = CacheRequest("a", list(range(9)), hasher=BlockHasher(BS), lora_id=7, cache_salt="tenant-1",
                     mm_items=[MultiModalItem("img", 4, 4)])
    schedule(mgr, a)
    mgr.end_schedule_step()
    mgr.free(a)
    schedule(mgr, make_request("b", list(range(100, 109)), BS))  # a's two blocks go to the host tier
    mgr.end_schedule_step()
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    (device,) = [e for e in stored if e.medium != HostBlockPool.medium and a.block_hashes[0] in e.block_hashes]
    assert device.lora_id == 7 and device.extra_keys is not None and len(device.extra_keys) == 2
    host = {e.block_hashes[0]: e for e in stored if e.medium == HostBlockPool.medium}
    for i in (0, 1):
        e = host[a.block_hashes[i]]
        assert e.lora_id == 7 and e.extra_keys == [device.extra_keys[i]]
        assert e.token_ids == list(range(4 * i, 4 * i + 4))
    mgr.check_integrity()


def test_a_swap_in_between_device_hits_publishes_only_its_own_blocks_and_tokens() -> None:
    """A sliding window releases a chain's head first, so a hit can be [host copy, device block]: the
    swapped-in block's BlockStored lists it alone, with its own 4 tokens (not the device hit's too)."""
    mgr = KVCacheManager(4, BS, specs=[SlidingWindowSpec(block_size=BS, sliding_window=8)], num_host_blocks=4,
                         enable_kv_events=True)
    a = make_request("a", list(range(9)), BS)
    schedule(mgr, a)
    mgr.end_schedule_step()
    mgr.free(a)  # blocks 0 and 1 cached, 0 released first
    b = make_request("b", list(range(100, 105)), BS)
    schedule(mgr, b)  # evicts a's block 0 to the host tier
    mgr.end_schedule_step()
    mgr.free(b)
    mgr.take_events()
    c = make_request("c", list(range(9)), BS)
    hit, n = mgr.get_computed_blocks(c)
    assert [b.on_host for b in hit.blocks[0]] == [True, False] and n == 8
    assert mgr.allocate_slots(c, c.num_tokens - n, n, hit) is not None
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored) and e.medium != HostBlockPool.medium]
    assert [(e.block_hashes, e.token_ids, e.parent_block_hash) for e in stored] == [
        ([c.block_hashes[0]], [0, 1, 2, 3], None)]
    mgr.check_integrity()


def test_lookup_continues_into_the_host_tier_and_allocation_swaps_in() -> None:
    mgr = KVCacheManager(6, BS, num_host_blocks=4)
    fill_and_evict(mgr)
    c = make_request("c", list(range(13)), BS)
    hit, n = mgr.get_computed_blocks(c)
    assert hit.get_block_ids() == ([1],) and [b.block_id for b in hit.host_blocks] == [1, 0]
    assert n == 12 and mgr.stats.host_hits == 0  # (counted when the request is admitted)
    new = mgr.allocate_slots(c, c.num_tokens - n, n, hit)
    assert (mgr.stats.hits, mgr.stats.host_hits) == (12, 8)
    assert new.get_block_ids() == ([5],)
    # The host hits land in the next free device blocks (b's tail, 2 and 3), themselves sheltered first.
    assert mgr.get_block_ids("c") == ([1, 2, 3, 5],)
    plan = mgr.end_schedule_step()
    assert plan.swap_out == [(2, 2), (3, 3)]
    assert plan.swap_in == [(1, 2), (0, 3)]
    # Device blocks 2 and 3 now hold a's content again (and its hashes); b's is in the host tier.
    assert [mgr.block_pool.blocks[i].block_hash for i in (2, 3)] == c.block_hashes[1:3]
    mgr.check_integrity()


def test_allocation_that_does_not_fit_changes_neither_tier() -> None:
    mgr = KVCacheManager(6, BS, num_host_blocks=4)
    fill_and_evict(mgr)
    x = make_request("x", [*range(12), *range(500, 520)], BS)  # 3 hits (1 device, 2 host) + 5 new
    hit, n = mgr.get_computed_blocks(x)
    assert n == 12 and len(hit.host_blocks) == 2
    before = snapshot(mgr)
    assert mgr.allocate_slots(x, x.num_tokens - n, n, hit) is None
    assert snapshot(mgr) == before
    assert not mgr.end_schedule_step()
    mgr.check_integrity()


def test_write_through_copies_new_blocks_in_the_next_plan() -> None:
    mgr = KVCacheManager(8, BS, num_host_blocks=8, write_through=True)
    a = make_request("a", list(range(10)), BS)
    schedule(mgr, a)
    # Not before this step's forward has computed them: the copies come with the next plan.
    assert not mgr.end_schedule_step()
    assert mgr.end_schedule_step().swap_out == [(1, 0), (2, 1)]
    mgr.free(a)
    big = make_request("big", list(range(200, 228)), BS)  # evicts everything a cached
    schedule(mgr, big)
    assert mgr.end_schedule_step().swap_out == []  # already in the host tier: nothing to copy
    mgr.check_integrity()


def test_host_lru_order_exact() -> None:
    h = HostBlockPool(3)
    for i in range(3):
        assert h.shelter(b"h%d" % i).block_id == i
    h.free_blocks(h.blocks)  # the step's copies ran: unpinned
    assert h.free_block_ids() == [0, 1, 2]
    assert h.shelter(b"h0") is None  # already held: refreshed to most recently used
    assert h.free_block_ids() == [1, 2, 0]
    blk = h.shelter(b"h3")
    assert blk.block_id == 1 and b"h1" not in h.cached
    h.free_blocks([blk])
    assert h.free_block_ids() == [2, 0, 1]
    h.check_integrity()


def test_host_arc_keeps_frequently_used_blocks() -> None:
    h = HostBlockPool(3, eviction="arc")
    arc_policy = h.policy
    blocks = [h.shelter(b"a"), h.shelter(b"b"), h.shelter(b"c")]
    h.free_blocks(blocks)
    h.touch([h.cached[b"a"]])  # a swap-in reads "a": it becomes frequent (t2)
    h.free_blocks([h.cached[b"a"]])
    assert list(arc_policy.t1) == [b"b", b"c"] and list(arc_policy.t2) == [b"a"]
    d = h.shelter(b"d")  # evicts the LRU of t1 ("b"), not "a"
    h.free_blocks([d])
    assert set(h.cached) == {b"a", b"c", b"d"} and list(arc_policy.b1) == [b"b"]
    e = h.shelter(b"b")  # a ghost hit: "b" was evicted too early, t1's target grows; it enters t2
    h.free_blocks([e])
    assert arc_policy.p == 1 and list(arc_policy.t2) == [b"a", b"b"] and list(arc_policy.t1) == [b"d"]
    assert e.block_id == blocks[2].block_id  # "c" (LRU of t1, now above its target) made room
    assert set(h.cached) == {b"a", b"b", b"d"} and list(arc_policy.b1) == [b"c"]
    h.check_integrity()
    # The difference from LRU shows on a scan of new hashes: LRU flushes everything, ARC keeps t2.
    lru = HostBlockPool(3)
    bl = [lru.shelter(x) for x in (b"a", b"b", b"c")]
    lru.free_blocks(bl)
    for x in (b"s1", b"s2", b"s3"):  # a scan of new hashes flushes LRU entirely
        lru.free_blocks([lru.shelter(x)])
    assert b"a" not in lru.cached
    arc = HostBlockPool(3, eviction="arc")
    bl = [arc.shelter(x) for x in (b"a", b"b", b"c")]
    arc.free_blocks(bl)
    arc.touch([arc.cached[b"a"]])
    arc.free_blocks([arc.cached[b"a"]])
    for x in (b"s1", b"s2", b"s3"):
        arc.free_blocks([arc.shelter(x)])
    assert b"a" in arc.cached  # the frequently used block survives the scan


def test_bad_policy_and_reset() -> None:
    with pytest.raises(ValueError, match="host_eviction"):
        HostBlockPool(4, eviction="fifo")
    mgr = KVCacheManager(6, BS, num_host_blocks=4)
    fill_and_evict(mgr)
    assert mgr.host_pool.cached
    assert mgr.reset_prefix_cache() is True
    assert not mgr.host_pool.cached and not mgr.block_pool.cached
    mgr.check_integrity()


def test_swap_in_sources_are_pinned_against_same_step_evictions() -> None:
    mgr = KVCacheManager(5, BS, num_host_blocks=2)  # 4 device blocks, 2 host blocks
    a = make_request("a", list(range(8)), BS)
    schedule(mgr, a)
    mgr.end_schedule_step()
    mgr.free(a)
    b = make_request("b", list(range(100, 116)), BS)
    schedule(mgr, b)
    assert mgr.end_schedule_step().swap_out == [(2, 0), (1, 1)]  # a's blocks sheltered, the host is full
    mgr.free(b)
    c = make_request("c", [*range(8), 7], BS)
    hit, n = mgr.get_computed_blocks(c)
    assert [h.block_id for h in hit.host_blocks] == [1, 0] and n == 8
    mgr.allocate_slots(c, 1, n, hit)
    plan = mgr.end_schedule_step()
    # Making room evicts three of b's blocks from the device; the host could only take them by
    # evicting the very blocks this step reads: it must not, so they are dropped instead.
    assert plan.swap_in == [(1, 1), (0, 2)]
    assert plan.swap_out == []
    assert mgr.host_pool.cached[a.block_hashes[0]].block_id == 1
    mgr.check_integrity()


def test_host_events_of_a_second_layer_group_name_it_and_its_raw_hash() -> None:
    # Full attention + sliding window: group 1's host keys carry a group byte. Its host BlockRemoved must
    # say what its BlockStored said (the raw 32-byte hash, group 1), or an indexer never drops the block.
    from kvpool.core.events import BlockRemoved, BlockStored
    from kvpool.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec

    bs = 4
    mgr = KVCacheManager(5, bs, specs=[FullAttentionSpec(block_size=bs), SlidingWindowSpec(block_size=bs,
                                                                                           sliding_window=4)],
                         num_host_blocks=2, enable_kv_events=True)
    for i in range(4):  # each request caches one full block per group, pushing the last one's to the host
        r = make_request(f"r{i}", [100 * i + j for j in range(5)], bs)
        hit, n = mgr.get_computed_blocks(r)
        assert mgr.allocate_slots(r, 5 - n, n, hit) is not None
        r.num_computed_tokens = 5
        mgr.free(r)
        mgr.end_schedule_step()
    host = [e for e in mgr.take_events() if e.medium == "CPU"]
    stored = {(e.group_id, h) for e in host if isinstance(e, BlockStored) for h in e.block_hashes}
    removed = [(e.group_id, h) for e in host if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert {g for g, _ in removed} == {0, 1} and len(removed) == 4
    assert all(len(h) == 32 for _, h in removed) and set(removed) <= stored


def test_an_evicted_block_whose_duplicate_stays_on_the_device_is_not_copied_to_the_host() -> None:
    # a and b computed the same blocks at once, so b holds duplicate copies. When a's copies are evicted,
    # b's take over the hashes: a host copy would only take a host block from something else.
    mgr = KVCacheManager(10, BS, num_host_blocks=4)
    a, b = make_request("a", list(range(8)), BS), make_request("b", list(range(8)), BS)
    assert mgr.allocate_slots(a, 8).get_block_ids() == ([1, 2],)
    assert mgr.allocate_slots(b, 8).get_block_ids() == ([3, 4],)
    mgr.end_schedule_step()
    mgr.free(a)
    mgr.free(b)
    c = make_request("c", list(range(100, 128)), BS)  # 7 blocks: the 5 never used, then a's copies
    assert mgr.allocate_slots(c, 28).get_block_ids() == ([5, 6, 7, 8, 9, 2, 1],)
    plan = mgr.end_schedule_step()
    assert plan.swap_out == [] and mgr.host_pool.cached == {}
    q = make_request("q", list(range(9)), BS)
    hit, n = mgr.get_computed_blocks(q)
    assert n == 8 and hit.get_block_ids() == ([3, 4],)
    # When the last device copies go, they are sheltered as any evicted block is.
    mgr.free(c)
    d = make_request("d", list(range(200, 236)), BS)
    assert mgr.allocate_slots(d, 36) is not None
    plan = mgr.end_schedule_step()
    assert sorted(dst for _, dst in plan.swap_out) == [0, 1, 2, 3]
    assert a.block_hashes[0] in mgr.host_pool.cached and a.block_hashes[1] in mgr.host_pool.cached
    mgr.free(d)
    mgr.check_integrity()
