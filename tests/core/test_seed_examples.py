"""The seeds' own worked examples, as exact block ids.

kvpool reserves block 0 as the null block, so the seeds' block i is kvpool's block i + 1.
"""

from __future__ import annotations

from helpers import Words, decode, make_request, schedule

from kvpool.core.kv_cache_manager import KVCacheManager


def test_quick_brown_fox(words: Words) -> None:
    # The omni seed: 8 blocks of 4 tokens; a 12-token request, then one sharing its first block.
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    r1 = make_request("r1", words("The quick brown fox was tired and slept beneath the shady tree"), 4)
    assert schedule(mgr, r1) is not None
    assert mgr.get_block_ids("r1") == ([1, 2, 3],)
    mgr.free(r1)
    # Freed tail first: the chain's end is evicted before its head.
    assert mgr.block_pool.free_block_ids() == [4, 5, 6, 7, 8, 3, 2, 1]

    r2 = make_request("r2", words("The quick brown fox jumped over the dog"), 4)
    hit, n_hit = mgr.get_computed_blocks(r2)
    assert n_hit == 4 and hit.get_block_ids() == ([1],)
    new = mgr.allocate_slots(r2, r2.num_tokens - n_hit, n_hit, hit)
    assert new is not None and new.get_block_ids() == ([4],)  # the seed's "block 3", the first empty one
    assert mgr.get_block_ids("r2") == ([1, 4],)
    assert mgr.block_pool.blocks[1].ref_cnt == 1
    assert mgr.block_pool.free_block_ids() == [5, 6, 7, 8, 3, 2]
    mgr.check_integrity()


def test_duplicate_blocks_of_identical_greedy_requests() -> None:
    # The V1 PR's timeline: block size 16, two identical prompts of 3 full blocks + 14 tokens.
    bs = 16
    prompt = list(range(1000, 1000 + 3 * bs + 14))
    mgr = KVCacheManager(num_blocks=16, block_size=bs)
    req1 = make_request("req1", prompt, bs)
    schedule(mgr, req1)  # time 1: req1 [0, 1, 2, 3 (14/16)]
    assert mgr.get_block_ids("req1") == ([1, 2, 3, 4],)

    decode(mgr, req1, 7)  # time 2: req1 15/16; req2 arrives and shares the full blocks only
    req2 = make_request("req2", prompt, bs)
    hit, n_hit = mgr.get_computed_blocks(req2)
    assert n_hit == 3 * bs
    schedule(mgr, req2)
    assert mgr.get_block_ids("req2") == ([1, 2, 3, 5],)

    decode(mgr, req1, 8)  # time 3: req1's last block is full and cached
    decode(mgr, req2, 7)
    h3 = req1.block_hashes[3]
    assert mgr.block_pool.cached[h3].block_id == 4

    decode(mgr, req2, 8)  # time 4: req2's block has the same hash: a duplicate, not merged
    assert req2.block_hashes[3] == h3
    assert mgr.block_pool.cached[h3].block_id == 4
    assert [b.block_id for b in mgr.block_pool._dups[h3]] == [5]

    # A third request hits the first block holding the hash.
    req3 = make_request("req3", [*prompt, 7, 8, 9], bs)
    hit, n_hit = mgr.get_computed_blocks(req3)
    assert hit.get_block_ids() == ([1, 2, 3, 4],) and n_hit == 4 * bs

    # Evicting the duplicate keeps the primary entry; the primary stays a hit.
    mgr.free(req2)
    assert mgr.block_pool.free_block_ids() == [*range(6, 16), 5]
    filler = make_request("filler", list(range(10 * bs + 1)), bs)
    schedule(mgr, filler)  # 11 blocks: the 10 never used, then the duplicate
    assert mgr.get_block_ids("filler") == ([*range(6, 16), 5],)
    assert mgr.block_pool.cached[h3].block_id == 4 and h3 not in mgr.block_pool._dups
    hit, _ = mgr.get_computed_blocks(req3)
    assert hit.get_block_ids() == ([1, 2, 3, 4],)
    mgr.check_integrity()


def test_evicting_primary_promotes_the_duplicate() -> None:
    bs = 4
    prompt = list(range(2000, 2000 + bs + 3))
    mgr = KVCacheManager(num_blocks=8, block_size=bs)
    a, b = make_request("a", prompt, bs), make_request("b", prompt, bs)
    schedule(mgr, a)
    schedule(mgr, b)  # hits a's first block; both have a partial second block
    decode(mgr, a, 1)
    decode(mgr, b, 1)
    h = a.block_hashes[1]
    assert (mgr.get_block_ids("a"), mgr.get_block_ids("b")) == (([1, 2],), ([1, 3],))
    assert mgr.block_pool.cached[h].block_id == 2
    mgr.free(a)
    mgr.free(b)
    # Queue: 4..7 never used, then a's tail (2), then b's tail (3) and the shared head (1).
    assert mgr.block_pool.free_block_ids() == [4, 5, 6, 7, 2, 3, 1]
    c = make_request("c", list(range(50, 50 + 4 * bs)), bs)
    schedule(mgr, c)  # takes 4, 5, 6, 7
    d = make_request("d", list(range(90, 90 + 1)), bs)
    schedule(mgr, d)  # evicts block 2, the primary: block 3 takes over the hash
    assert mgr.get_block_ids("d") == ([2],)
    assert mgr.block_pool.cached[h].block_id == 3
    e = make_request("e", [*prompt, 1, 5], bs)
    hit, n_hit = mgr.get_computed_blocks(e)
    assert hit.get_block_ids() == ([1, 3],) and n_hit == 2 * bs
    mgr.check_integrity()


def test_eviction_order_after_freeing_requests_that_share_a_prefix() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=11, block_size=bs)
    p = list(range(10, 18))  # two shared blocks
    a = make_request("a", [*p, 20, 21, 22, 23], bs)  # 3 full blocks
    b = make_request("b", [*p, 30, 31, 32, 33, 34, 35], bs)  # 14 tokens: 3 full blocks + 2
    schedule(mgr, a)
    schedule(mgr, b)
    assert mgr.get_block_ids("a") == ([1, 2, 3],)
    assert mgr.get_block_ids("b") == ([1, 2, 4, 5],)
    mgr.free(a)
    assert mgr.block_pool.free_block_ids() == [6, 7, 8, 9, 10, 3]
    mgr.free(b)
    # b's partial block 5 holds nothing cached: reused first. Then LRU, tail of each chain first.
    assert mgr.block_pool.free_block_ids() == [5, 6, 7, 8, 9, 10, 3, 4, 2, 1]
    assert [b.ref_cnt for b in mgr.block_pool.blocks[1:6]] == [0, 0, 0, 0, 0]

    big = make_request("big", list(range(500, 500 + 8 * bs)), bs)
    schedule(mgr, big)
    assert mgr.get_block_ids("big") == ([5, 6, 7, 8, 9, 10, 3, 4],)
    # a's and b's tails were evicted; the shared prefix survives and is still a hit.
    c = make_request("c", [*p, 20, 21, 22, 23], bs)
    hit, n_hit = mgr.get_computed_blocks(c)
    assert hit.get_block_ids() == ([1, 2],) and n_hit == 8
    mgr.check_integrity()
