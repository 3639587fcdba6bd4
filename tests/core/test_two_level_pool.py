"""Two-level pages: large pages of the LCM size split per page size, exact ids, one LRU across types."""

from __future__ import annotations

import pytest
from helpers import make_request, snapshot

from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import FullAttentionSpec, MambaSpec
from kvpool.core.two_level_pool import TwoLevelBlockPool

BS = 4
FULL = FullAttentionSpec(block_size=BS)
MAMBA = MambaSpec(block_size=BS, state_shapes=((2, 3),), state_dtype_bytes=(2,))


def make() -> KVCacheManager:
    # Attention pages of 2 units, Mamba pages of 3: large pages of 6 hold 3 or 2 of them; 3 usable.
    return KVCacheManager(4, BS, specs=[FULL, MAMBA], page_sizes=[2, 3])


def test_large_pages_are_split_per_type_and_reused_least_recently_used_first() -> None:
    mgr = make()
    pool = mgr.block_pool
    assert isinstance(pool, TwoLevelBlockPool) and pool.large_page_size == 6
    assert [t.per_large for t in pool.types] == [3, 2]
    a = make_request("a", list(range(8)), BS)
    assert mgr.allocate_slots(a, 8) is not None
    # Attention ids 3-5 are large page 1; Mamba ids 4-5 are large page 2.
    assert mgr.get_block_ids("a") == ([3, 4], [0, 4])
    assert pool.owner == [-1, 0, 1, None]
    mgr.free(a)
    assert pool.free_block_ids() == [(), (), (3, 1, 2)]  # unowned first, then least recently used
    b = make_request("b", list(range(100, 128)), BS)
    before = snapshot(mgr)
    assert mgr.allocate_slots(b, 28) is None  # 7 attention pages (3 large) + 1 Mamba (1 large) > 3
    assert snapshot(mgr) == before
    c = make_request("c", list(range(200, 220)), BS)
    assert mgr.allocate_slots(c, 20) is not None  # 5 attention pages (2 large) + 1 Mamba page
    # Attention opens large page 3, then takes back its own large page 1: the uncached page 5 first,
    # then a's page 4 (the tail of a's chain, freed first); a's first block (page 3) stays cached.
    assert mgr.get_block_ids("c") == ([9, 10, 11, 5, 4], [0, 0, 0, 0, 5])
    assert pool.types[0].blocks[3].block_hash == a.block_hashes[0]
    assert pool.types[1].blocks[4].block_hash is not None  # a's state after 8 tokens, still cached
    _, n = mgr.get_computed_blocks(make_request("a2", list(range(9)), BS))
    assert n == 0  # a's first attention block survives, but the state after it was never stored
    mgr.check_integrity()


def test_a_wholly_free_large_page_of_another_type_is_reclaimed_when_it_is_the_oldest() -> None:
    mgr = make()
    pool = mgr.block_pool
    a = make_request("a", list(range(12)), BS)
    assert mgr.allocate_slots(a, 12) is not None
    assert mgr.get_block_ids("a") == ([3, 4, 5], [0, 0, 4])
    mgr.free(a)  # large page 1 (attention) freed before large page 2 (Mamba): it is the older
    b = make_request("b", list(range(100, 105)), BS)
    assert mgr.allocate_slots(b, 5) is not None
    # Attention opens the unowned large page 3; Mamba needs a large page: the least recently used is
    # attention's page 1, whose cached blocks are evicted and which changes type (Mamba ids 2-3).
    assert mgr.get_block_ids("b") == ([9, 10], [0, 2])
    assert pool.owner == [-1, 1, 1, 0]
    assert all(blk.block_hash is None for blk in pool.types[0].blocks[3:6])
    assert pool.types[1].blocks[4].block_hash is not None  # a's last state is kept
    _, n = mgr.get_computed_blocks(make_request("a2", list(range(13)), BS))
    assert n == 0  # the state survived, but the attention blocks before it did not
    mgr.check_integrity()
    mgr.free(b)
    assert mgr.get_num_free_blocks() == 3 and mgr.usage == 0.0
    assert mgr.reset_prefix_cache() and not pool.cached


def test_two_level_pool_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="page_sizes: 1 sizes for 2 groups"):
        KVCacheManager(4, BS, specs=[FULL, MAMBA], page_sizes=[2])
    with pytest.raises(ValueError, match=r"page_sizes: need positive ints, got \[2, 0\]"):
        KVCacheManager(4, BS, specs=[FULL, MAMBA], page_sizes=[2, 0])
    with pytest.raises(ValueError, match="num_large_pages: need at least 2"):
        KVCacheManager(1, BS, specs=[FULL, MAMBA], page_sizes=[2, 3])
