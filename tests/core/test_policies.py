"""The eviction policies beyond LRU: exact eviction orders on small pools, and the learning signals."""

from __future__ import annotations

import pytest
from helpers import run_request, schedule

from kvpool.core.block_pool import DeviceBlockPool
from kvpool.core.eviction import make_policy, policy_names
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.policies import GreedyDualPolicy, ReusePolicy, SLRUPolicy
from kvpool.core.request import CacheRequest

BS = 4


def manager(policy: str, num_blocks: int = 9) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, eviction_policy=policy)


def run(mgr: KVCacheManager, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    return run_request(mgr, rid, tokens, BS)


def test_registry_names_and_errors() -> None:
    assert {"lru", "slru", "prefix", "reuse", "lhd", "adaptive"} <= set(policy_names())
    assert isinstance(make_policy("slru"), SLRUPolicy)
    with pytest.raises(ValueError, match=r"eviction_policy: 'mru' is not one of \['adaptive', 'lhd', 'lru', 'prefix'"):
        make_policy("mru")
    with pytest.raises(ValueError, match="host_eviction: 'mru' is not one of"):
        KVCacheManager(8, BS, num_host_blocks=4, host_eviction="mru")


@pytest.mark.parametrize("policy", ["slru", "prefix", "reuse", "lhd", "adaptive"])
def test_empty_blocks_first_in_id_order_then_low_then_cached(policy: str) -> None:
    pool = DeviceBlockPool(6, eviction_policy=policy)
    assert pool.free_block_ids() == [1, 2, 3, 4, 5]
    a, b, c, _d = pool.get_new_blocks(4)
    a.block_hash, b.block_hash = b"a", b"b"  # cached content (as the pool's caching would set it)
    pool.cached.update({b"a": a, b"b": b})
    pool.free_blocks([a, c])  # a keeps content, c holds nothing: reused before any cached block
    pool.free_blocks_to_front([b])  # low value: after the empty blocks, before a
    assert pool.free_block_ids() == [3, 5, 2, 1]
    assert [x.block_id for x in pool.get_new_blocks(4)] == [3, 5, 2, 1]
    pool.check_map()


def test_greedy_dual_with_equal_values_is_lru() -> None:
    # The seeds' rule: least recently freed first, a chain's tail before its head.
    lru = manager("lru")
    gd = KVCacheManager(9, BS, block_pool=DeviceBlockPool(9, eviction_policy=GreedyDualPolicy()))
    for mgr in (lru, gd):
        run(mgr, "a", list(range(9)))  # blocks 1, 2 cached (2 full blocks) + 3 partial
        run(mgr, "b", list(range(100, 109)))
    # b took 3, 4, 5 (the empty blocks first): its partial block 5 at the head, its chain after a's.
    assert gd.block_pool.free_block_ids() == lru.block_pool.free_block_ids() == [5, 6, 7, 8, 2, 1, 4, 3]


def test_slru_keeps_a_reused_prefix_over_later_one_offs() -> None:
    mgr = manager("slru")
    run(mgr, "a", list(range(9)))  # caches [1, 2] (blocks of 0..7)
    _, hit = run(mgr, "a2", list(range(9)))
    assert hit == 8  # a hit: blocks 1 and 2 are protected from now on
    assert mgr.block_pool.free_block_ids()[-2:] == [2, 1]
    run(mgr, "b", list(range(100, 109)))  # one-offs flow through probation
    run(mgr, "c", list(range(200, 209)))
    run(mgr, "d", list(range(300, 309)))
    run(mgr, "e", list(range(400, 409)))
    # Under LRU these four one-offs (8 cached blocks + 4 partial) push out a's prefix.
    _, hit = run(mgr, "a3", list(range(9)))
    assert hit == 8
    lru = manager("lru")
    for rid, base in (("a", 0), ("a2", 0), ("b", 100), ("c", 200), ("d", 300), ("e", 400), ("a3", 0)):
        _, hit = run(lru, rid, list(range(base, base + 9)))
    assert hit == 0


def test_prefix_values_blocks_by_requests_through_them() -> None:
    mgr = manager("prefix", num_blocks=8)
    run(mgr, "sys", list(range(9)))
    for i in range(3):  # the system prompt is hit three times
        _, hit = run(mgr, f"q{i}", [*range(8), 50 + i])
        assert hit == 8
    pool = mgr.block_pool
    order = pool.free_block_ids()
    # The system blocks (ids 1 and 2, hit three times) are evicted last, the head after its child.
    assert order[-2:] == [2, 1]


def test_reuse_policy_learns_from_ghost_returns() -> None:
    pol = ReusePolicy()
    mgr = KVCacheManager(6, BS, block_pool=DeviceBlockPool(6, eviction_policy=pol))
    run(mgr, "a", list(range(9)))  # caches 2 blocks
    run(mgr, "b", list(range(100, 117)))  # 4 full blocks + 1: evicts a's blocks into the ghost list
    assert len(pol.ghosts) >= 2 and all(c >= 0 for c in pol.ghosts.values())
    trials_before = pol.cnt_g
    successes_before = pol.pos_g
    _, hit = run(mgr, "a2", list(range(9)))  # a miss: a's hashes come back from the ghost list
    assert hit == 0
    assert pol.pos_g >= successes_before + 2  # two evictions that cost a hit
    assert pol.cnt_g >= trials_before
    # Those blocks are now known to be reused: a class of hit blocks.
    hit_blocks = [b for b in mgr.block_pool.blocks if b.block_hash is not None and pol.hits[b.block_id]]
    assert len(hit_blocks) == 2


def test_reuse_policy_evicts_a_class_that_is_never_reused_first() -> None:
    # Train: long prompts (3 blocks) are reused, short ones (1 block) never are. Then a short and a
    # long prompt are freed, the long one first: LRU would evict the long one first; reuse keeps it.
    pol = ReusePolicy()
    mgr = KVCacheManager(40, BS, block_pool=DeviceBlockPool(40, eviction_policy=pol))
    base = 1000
    for i in range(30):
        long = list(range(base, base + 13))
        run(mgr, f"L{i}", long)
        run(mgr, f"L{i}r", long)  # reused at once
        run(mgr, f"S{i}", [base + 500, base + 501, base + 502, base + 503, 7])  # never again
        base += 1000
    long, short = list(range(90000, 90013)), [95000, 95001, 95002, 95003, 7]
    long_ids, _ = run(mgr, "Lx", long)
    short_ids, _ = run(mgr, "Sx", short)
    order = mgr.block_pool.free_block_ids()
    cached_order = [i for i in order if mgr.block_pool.blocks[i].block_hash is not None]
    assert cached_order.index(short_ids[0]) < min(cached_order.index(i) for i in long_ids[:3])


def run_with_output(mgr: KVCacheManager, rid: str, prompt: list[int], output: list[int]) -> list[int]:
    """Prefill `prompt`, decode `output` one token a step, finish: the request's block ids."""
    return run_request(mgr, rid, prompt, BS, output)[0]


class RecordingPolicy(ReusePolicy):
    """`reuse`, logging what the pool tells it about releases."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, object]] = []

    def on_release(self, num_output_tokens: int | None) -> None:
        self.log.append(("release", num_output_tokens))
        super().on_release(num_output_tokens)

    def append_n(self, blocks) -> None:  # type: ignore[no-untyped-def]
        self.log.append(("append", [b.block_id for b in blocks]))
        super().append_n(blocks)


def test_a_release_tells_the_policy_how_many_tokens_the_request_generated() -> None:
    pol = RecordingPolicy()
    mgr = KVCacheManager(12, BS, block_pool=DeviceBlockPool(12, eviction_policy=pol))
    ids = run_with_output(mgr, "a", list(range(9)), [50, 51, 52])  # 12 tokens: 3 full blocks
    assert pol.log == [("release", 3), ("append", ids[::-1])]
    pol.log.clear()
    req = CacheRequest("b", list(range(100, 108)), hasher=BlockHasher(BS))
    assert mgr.allocate_slots(req, 8) is not None
    req.num_computed_tokens = 8
    mgr.free("b")  # by id: what it generated is not known
    assert pol.log[0] == ("release", None)
    assert pol.out[ids[0]] == 3  # bucket of 3 tokens: 2-3


def test_reuse_policy_learns_which_output_lengths_are_continued() -> None:
    # Train: requests that answer in one token are continued at once (their prompt comes back), those
    # that answer in two never are; prompts and cached chains look alike (two full blocks each).
    # Then a short and a long answer are released, the short one first: LRU would evict the short
    # one first; reuse keeps it.
    def trained(policy: str) -> tuple[list[int], list[int]]:
        mgr = KVCacheManager(60, BS, eviction_policy=policy)
        base = 1000
        for i in range(40):
            prompt = list(range(base, base + 9))
            run_with_output(mgr, f"S{i}", prompt, [7])
            run_with_output(mgr, f"S{i}c", prompt, [8])  # continued: a hit on the whole prompt
            run_with_output(mgr, f"L{i}", list(range(base + 500, base + 509)), [1, 2])
            base += 1000
        short_ids = run_with_output(mgr, "Sx", list(range(90000, 90009)), [7])
        long_ids = run_with_output(mgr, "Lx", list(range(95000, 95009)), [1, 2])
        order = [i for i in mgr.block_pool.free_block_ids() if mgr.block_pool.blocks[i].block_hash is not None]
        assert len(short_ids) == len(long_ids) == 3  # two full blocks, cached; a partial one, not
        return [order.index(i) for i in short_ids[:2]], [order.index(i) for i in long_ids[:2]]

    short_pos, long_pos = trained("lru")
    assert max(short_pos) < min(long_pos)  # LRU: released first, evicted first
    short_pos, long_pos = trained("reuse")
    assert max(long_pos) < min(short_pos)  # reuse: every block of the long answer goes first


def test_schedule_helper_under_every_policy() -> None:
    for policy in policy_names():
        mgr = manager(policy)
        req = CacheRequest("x", list(range(12)), hasher=BlockHasher(BS))
        assert schedule(mgr, req) is not None
        mgr.free(req)
        mgr.check_integrity()
        assert mgr.get_num_free_blocks() == 8
