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
    # Unowned first, then least recently used: a's blocks are released unit by unit across groups
    # (the state after 8 tokens with the attention block it needs, then the first attention block), so
    # the Mamba large page (2) is wholly free before the attention one (1).
    assert pool.free_block_ids() == [(), (), (3, 2, 1)]
    b = make_request("b", list(range(100, 128)), BS)
    before = snapshot(mgr)
    assert mgr.allocate_slots(b, 28) is None  # 7 attention pages (3 large) + 1 Mamba (1 large) > 3
    assert snapshot(mgr) == before
    c = make_request("c", list(range(200, 220)), BS)
    assert mgr.allocate_slots(c, 20) is not None  # 5 attention pages (2 large) + 1 Mamba page
    # Attention opens large page 3, then takes the least recently used one, Mamba's page 2 (ids 6-8);
    # Mamba takes attention's large page 1 (ids 2-3), evicting a's first attention block with it.
    assert mgr.get_block_ids("c") == ([9, 10, 11, 6, 7], [0, 0, 0, 0, 2])
    assert pool.owner == [-1, 1, 0, 0]
    assert a.block_hashes[0] not in pool.cached
    _, n = mgr.get_computed_blocks(make_request("a2", list(range(9)), BS))
    assert n == 0
    mgr.check_integrity()


def test_a_freed_prefix_stays_usable_as_a_unit_across_page_types() -> None:
    mgr = make()
    pool = mgr.block_pool
    a = make_request("a", list(range(12)), BS)
    assert mgr.allocate_slots(a, 12) is not None
    assert mgr.get_block_ids("a") == ([3, 4, 5], [0, 0, 4])
    # Released unit by unit: the state after 12 tokens and the attention block only it needs go first,
    # then the rest of the attention chain; so large page 2 (Mamba) is wholly free before page 1.
    mgr.free(a)
    assert pool.free_block_ids() == [(), (), (3, 2, 1)]
    b = make_request("b", list(range(100, 105)), BS)
    assert mgr.allocate_slots(b, 5) is not None
    # Attention opens the unowned large page 3; Mamba reuses its own large page 2 (its free page 5): no
    # page of a's usable prefix is evicted, so a's whole prompt but the last token is still a hit.
    assert mgr.get_block_ids("b") == ([9, 10], [0, 5])
    assert pool.owner == [-1, 0, 1, 0]
    _, n = mgr.get_computed_blocks(make_request("a2", list(range(13)), BS))
    assert n == 12
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
