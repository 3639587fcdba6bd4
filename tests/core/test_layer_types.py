"""Mamba state and cross-attention layers, page sizes, the grouping rule, and per-type eviction order."""

from __future__ import annotations

import re

import pytest
from helpers import make_request, snapshot

from kvpool.core.block import group_key
from kvpool.core.grouping import common_page_size, group_layers
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    dtype_bytes,
)
from kvpool.core.request import CacheRequest

BS = 4
FULL = FullAttentionSpec(block_size=BS)
SW = SlidingWindowSpec(block_size=BS, sliding_window=8)  # a hit needs the 2 blocks before it
MAMBA = MambaSpec(block_size=BS, state_shapes=((3, 4), (5,)), state_dtype_bytes=(2, 4))
CROSS = CrossAttentionSpec(block_size=BS)


def mark_cached(mgr: KVCacheManager, hashes: list[bytes], group: int, ids: dict[int, int]) -> None:
    """Hand-built pattern: block index -> the pool block that caches it in `group`."""
    pool = mgr.block_pool
    for i, bid in ids.items():
        blk = pool.blocks[bid]
        blk.block_hash = group_key(hashes[i], group)
        blk.group_id = group
        pool.cached[blk.block_hash] = blk


def lookup(mgr: KVCacheManager, n_tokens: int) -> tuple[tuple[list[int], ...], int]:
    hit, n = mgr.get_computed_blocks(make_request("q", list(range(n_tokens)), BS))
    return hit.get_block_ids(), n


# -- page sizes ------------------------------------------------------------------------------------------


def test_page_sizes_follow_the_layer_shape() -> None:
    # Llama-3 8B style: 8 KV heads of 128, bf16, 16 tokens: K and V = 2 * 16 * 8 * 128 * 2 bytes.
    assert FullAttentionSpec(16, 8, 128, dtype_bytes("bfloat16")).page_size_bytes == 65536
    assert SlidingWindowSpec(16, 8, 128, dtype_bytes("float32"), sliding_window=4096).page_size_bytes == 131072
    assert CrossAttentionSpec(16, 8, 128, 2).page_size_bytes == 65536
    # A state: conv (3 x 4) in 2-byte floats + ssm (5,) in 4-byte floats, independent of block_size.
    assert MAMBA.page_size_bytes == 3 * 4 * 2 + 5 * 4
    assert MambaSpec(block_size=64, state_shapes=((3, 4), (5,)), state_dtype_bytes=(2, 4)).page_size_bytes == 44


def test_cross_attention_admission_counts_encoder_tokens() -> None:
    # What one request holds at most: its encoder tokens' blocks, however long its text.
    spec = CrossAttentionSpec(block_size=4, max_encoder_tokens=10)
    assert spec.max_blocks_held(1000, 16) == 3 and spec.max_blocks_held(1, 1) == 3
    assert CrossAttentionSpec(block_size=4).max_blocks_held(1000, 16) == 0


@pytest.mark.parametrize(("make", "message"), [
    (lambda: FullAttentionSpec(block_size=0), "block_size: must be an int >= 1, got 0"),
    (lambda: FullAttentionSpec(block_size=4, head_size=-2), "head_size: must be an int >= 1, got -2"),
    (lambda: SlidingWindowSpec(block_size=4, sliding_window=0), "sliding_window: must be an int >= 1, got 0"),
    (lambda: MambaSpec(block_size=4), "state_shapes: a Mamba layer needs at least one state tensor"),
    (lambda: MambaSpec(block_size=4, state_shapes=((2,),), state_dtype_bytes=()),
     "state_dtype_bytes: 0 entries for 1 state shapes"),
    (lambda: MambaSpec(block_size=4, state_shapes=((2, 0),), state_dtype_bytes=(2,)),
     "state_shapes: every dimension must be an int >= 1, got (2, 0)"),
    (lambda: dtype_bytes("float64"), "dtype: unknown dtype 'float64'"),
    (lambda: CrossAttentionSpec(block_size=4, max_encoder_tokens=-1),
     "max_encoder_tokens: must be an int >= 0, got -1"),
    (lambda: CacheRequest("r", [1], num_encoder_tokens=-1), "num_encoder_tokens: must be an int >= 0, got -1"),
    (lambda: group_layers([]), "layer_specs: a model needs at least one layer"),
    (lambda: group_layers([FULL, FullAttentionSpec(block_size=8)]), "layer_specs: all layers need one block_size"),
    (lambda: KVCacheManager(8, BS, specs=[MAMBA], num_host_blocks=4, host_eviction="mru"),
     "host_eviction: 'mru' is not one of ['adaptive', 'arc', 'lhd', 'lru', 'prefix', 'reuse', 'slru']"),
])
def test_bad_specs_name_the_field(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


# -- grouping --------------------------------------------------------------------------------------------


def layers_of(groups: list, spec: KVCacheSpec) -> list[tuple[int, ...]]:  # type: ignore[type-arg]
    return [g.layers for g in groups if g.spec == spec]


def test_grouping_gemma2_alternating_layers() -> None:
    specs: list[KVCacheSpec] = [SW if i % 2 == 0 else FULL for i in range(42)]
    groups = group_layers(specs)
    assert [g.spec for g in groups] == [SW, FULL]
    assert layers_of(groups, SW) == [tuple(range(0, 42, 2))]
    assert layers_of(groups, FULL) == [tuple(range(1, 42, 2))]
    assert common_page_size(groups) == 21 * FULL.page_size_bytes


def test_grouping_gemma3_five_sliding_to_one_full() -> None:
    specs: list[KVCacheSpec] = [FULL if i % 6 == 5 else SW for i in range(18)]  # Gemma-3 270M: 18 layers
    groups = group_layers(specs)
    assert len(groups) == 6 and all(len(g.layers) == 3 for g in groups)
    assert layers_of(groups, FULL) == [(5, 11, 17)]
    assert layers_of(groups, SW) == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert common_page_size(groups) == 3 * SW.page_size_bytes


def test_grouping_mllama_as_in_the_rfc() -> None:
    cross_at = {3, 8, 13, 18, 23, 28, 33, 38}  # Llama-3.2-11B-Vision: 8 cross-attention of 40 layers
    specs: list[KVCacheSpec] = [CROSS if i in cross_at else FULL for i in range(40)]
    groups = group_layers(specs)
    assert len(groups) == 5 and all(len(g.layers) == 8 for g in groups)
    assert layers_of(groups, CROSS) == [tuple(sorted(cross_at))]
    assert layers_of(groups, FULL)[0] == (0, 1, 2, 4, 5, 6, 7, 9)
    assert common_page_size(groups) == 8 * FULL.page_size_bytes


def test_grouping_jamba_mamba_and_attention() -> None:
    attn = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
    mamba = MambaSpec(block_size=16, state_shapes=((8192, 3), (8192, 16)), state_dtype_bytes=(2, 2))
    specs: list[KVCacheSpec] = [attn if i % 8 == 4 else mamba for i in range(32)]  # 4 attention, 28 Mamba
    groups = group_layers(specs)
    assert len(groups) == 8 and all(len(g.layers) == 4 for g in groups)
    assert layers_of(groups, attn) == [(4, 12, 20, 28)]
    assert layers_of(groups, mamba)[0] == (0, 1, 2, 3)
    assert common_page_size(groups) is None  # two-level pages needed


# -- Mamba -----------------------------------------------------------------------------------------------


def test_mamba_hit_is_the_latest_boundary_with_a_cached_state() -> None:
    mgr = KVCacheManager(40, BS, specs=[MAMBA])
    hashes = make_request("h", list(range(25)), BS).block_hashes  # 6 full blocks
    mark_cached(mgr, hashes, 0, {1: 11, 3: 13})
    assert lookup(mgr, 25) == (([0, 0, 0, 13],), 16)  # the state after 4 blocks
    assert lookup(mgr, 16) == (([0, 11],), 8)  # at most 3 blocks (the last token is recomputed): block 3 is out
    mark_cached(mgr, hashes, 0, {5: 15})
    assert lookup(mgr, 25) == (([0, 0, 0, 0, 0, 15],), 24)
    assert lookup(mgr, 4) == (([],), 0)


def test_hybrid_hit_full_and_mamba_disagree() -> None:
    mgr = KVCacheManager(40, BS, specs=[FULL, MAMBA])
    hashes = make_request("h", list(range(29)), BS).block_hashes  # 7 full blocks
    mark_cached(mgr, hashes, 0, {i: 1 + i for i in range(5)})  # full attention: blocks 0-4
    mark_cached(mgr, hashes, 1, {2: 22, 5: 25})  # states after 3 and after 6 blocks
    # Full says 5, Mamba 6; at 5 Mamba has only the state after 3; at 3 both agree.
    assert lookup(mgr, 29) == (([1, 2, 3], [0, 0, 22]), 12)
    mark_cached(mgr, hashes, 1, {4: 24})
    assert lookup(mgr, 29) == (([1, 2, 3, 4, 5], [0, 0, 0, 0, 24]), 20)


def test_hybrid_hit_full_sliding_and_mamba() -> None:
    mgr = KVCacheManager(60, BS, specs=[FULL, SW, MAMBA])
    hashes = make_request("h", list(range(29)), BS).block_hashes
    mark_cached(mgr, hashes, 0, {i: 1 + i for i in range(7)})  # full: everything
    mark_cached(mgr, hashes, 1, {0: 20, 1: 21, 3: 23, 5: 25, 6: 26})  # window pairs end after 2, 7 blocks
    mark_cached(mgr, hashes, 2, {1: 41, 3: 43, 5: 45})  # states after 2, 4, 6 blocks
    # Full 7, window 7, Mamba 6 -> at 6: window needs 4-5 (4 missing) -> 2 -> all accept 2.
    assert lookup(mgr, 29) == (([1, 2], [20, 21], [0, 41]), 8)
    mark_cached(mgr, hashes, 1, {4: 24})
    assert lookup(mgr, 29) == (([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 24, 25], [0, 0, 0, 0, 0, 45]), 24)


def test_mamba_running_request_holds_only_its_latest_states() -> None:
    mgr = KVCacheManager(8, BS, specs=[MAMBA])  # blocks 1-7
    a = make_request("a", list(range(12)), BS)
    assert mgr.allocate_slots(a, 8) is not None  # chunked prefill: 8 tokens, the state after block 1
    a.num_computed_tokens = 8
    assert mgr.get_block_ids("a") == ([0, 1],)
    assert mgr.block_pool.blocks[1].block_hash == a.block_hashes[1]  # a state exactly at a boundary
    assert mgr.allocate_slots(a, 4) is not None  # the rest of the prompt: input page 1, output page 2
    a.num_computed_tokens = 12
    assert mgr.get_block_ids("a") == ([0, 1, 2],)
    a.append_output_token_ids(7)
    assert mgr.allocate_slots(a, 1) is not None  # decoding into block 3 (page 1 no longer needed)
    a.num_computed_tokens = 13
    assert mgr.get_block_ids("a") == ([0, 0, 2, 3],)
    assert mgr.block_pool.blocks[3].block_hash is None  # holds the state after 13 tokens: not a boundary
    # Page 1 (the state at the prompt's last boundary a repeat can hit) stays cached, at the tail.
    assert mgr.block_pool.free_block_ids() == [4, 5, 6, 7, 1]
    a.append_output_token_ids(8)
    assert mgr.allocate_slots(a, 1) is not None  # same block: the state is updated in place
    a.num_computed_tokens = 14
    assert mgr.get_block_ids("a") == ([0, 0, 0, 3],)  # the input state is now page 3 itself
    # Page 2 (the state at the prompt's end, after 12 tokens) is kept too.
    assert mgr.block_pool.free_block_ids() == [4, 5, 6, 7, 1, 2]
    mgr.check_integrity()
    mgr.free(a)
    # Page 3 holds a mid-block state: nothing can hit it, it goes first.
    assert mgr.block_pool.free_block_ids() == [3, 4, 5, 6, 7, 1, 2]
    b = make_request("b", [*range(12), 7, 8, 9, 10, 11, 12], BS)
    assert mgr.get_computed_blocks(b)[0].get_block_ids() == ([0, 0, 2],)
    mgr.check_integrity()


def test_mamba_one_shot_prefill_caches_only_its_end() -> None:
    mgr = KVCacheManager(8, BS, specs=[MAMBA])
    a = make_request("a", list(range(16)), BS)
    assert mgr.allocate_slots(a, 16) is not None
    assert mgr.get_block_ids("a") == ([0, 0, 0, 1],)
    assert [h for h, b in mgr.block_pool.cached.items()] == [a.block_hashes[3]]
    with pytest.raises(ValueError, match="num_lookahead_tokens: Mamba layers cannot hold speculative tokens"):
        mgr.allocate_slots(a, 1, num_lookahead_tokens=2)


def test_mamba_hit_takes_one_page_and_a_failed_allocation_changes_nothing() -> None:
    mgr = KVCacheManager(4, BS, specs=[FULL, MAMBA])  # 3 usable blocks
    a = make_request("a", list(range(8)), BS)
    assert mgr.allocate_slots(a, 8) is not None  # full: 2 blocks, Mamba: 1 page
    mgr.free(a)
    b = make_request("b", list(range(9)), BS)
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8 and hit.get_block_ids() == ([1, 2], [0, 3])
    before = snapshot(mgr)
    # Hits are free blocks (3) and the new token needs a full block and a Mamba page: 5 > 3.
    assert mgr.allocate_slots(b, 1, n, hit) is None
    assert snapshot(mgr) == before
    c = make_request("c", list(range(5)), BS)
    hit, n = mgr.get_computed_blocks(c)
    assert n == 0 and hit.get_block_ids() == ([], [])  # full alone would say 1, but no state after block 0
    mgr.check_integrity()


# -- cross-attention -------------------------------------------------------------------------------------


def test_cross_attention_blocks_cover_the_encoder_tokens_once() -> None:
    mgr = KVCacheManager(20, BS, specs=[CROSS, FULL])
    a = CacheRequest("a", list(range(6)), hasher=make_request("x", [1], BS).hasher, num_encoder_tokens=10)
    assert mgr.allocate_slots(a, 6) is not None
    a.num_computed_tokens = 6
    cross, full = mgr.get_block_ids("a")
    assert cross == [1, 2, 3] and full == [4, 5]  # ceil(10 / 4) blocks for the image tokens
    for t in range(5):
        a.append_output_token_ids(t)
        assert mgr.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    cross, full = mgr.get_block_ids("a")
    assert cross == [1, 2, 3] and full == [4, 5, 6]
    # Only the text is cached (full attention, group 1); no encoder block carries a hash.
    assert all(b.group_id == 1 for b in mgr.block_pool.cached.values()) and len(mgr.block_pool.cached) == 2
    mgr.free(a)
    assert mgr.block_pool.free_block_ids()[:4] == [6, 1, 2, 3]  # the partial text block and encoder blocks first
    # The cross-attention group does not limit a hit: the text prefix is found.
    b = CacheRequest("b", [*range(6), 0, 1, 4], hasher=a.hasher, num_encoder_tokens=10)
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8 and hit.get_block_ids() == ([], [4, 5])
    assert mgr.allocate_slots(b, 1, n, hit) is not None
    assert mgr.get_block_ids("b") == ([6, 1, 2], [4, 5, 3])
    mgr.check_integrity()


# -- eviction preferences --------------------------------------------------------------------------------


def test_sliding_window_keeps_the_window_before_boundaries_that_matter() -> None:
    mgr = KVCacheManager(40, BS, specs=[SW])
    a = make_request("a", list(range(30)), BS)
    assert mgr.allocate_slots(a, 30) is not None
    a.num_computed_tokens = 30
    assert mgr.get_block_ids("a") == ([1, 2, 3, 4, 5, 6, 7, 8],)
    a.append_output_token_ids(99)
    assert mgr.allocate_slots(a, 1) is not None
    a.num_computed_tokens = 31
    # Blocks 0-4 left the window; no hit can use them (the boundaries: hit point 0, prompt end 7). They
    # hold cached content, so they go to the LRU tail, oldest first, never ahead of never-used blocks.
    free = mgr.block_pool.free_block_ids()
    assert free[0] == 9 and free[-5:] == [1, 2, 3, 4, 5]
    mgr.free(a)
    # At the end the window before the last boundary (blocks 5, 6) is kept, released after the rest; the
    # partial block 7 (nothing cached) goes to the front.
    free = mgr.block_pool.free_block_ids()
    assert free[0] == 8 and free[-7:] == [1, 2, 3, 4, 5, 6, 7]
    # b shares 6 blocks: its hit needs only blocks 4-5 of a (ids 5, 6).
    b = make_request("b", [*range(24), *range(100, 110)], BS)
    hit, n = mgr.get_computed_blocks(b)
    assert n == 24 and hit.get_block_ids() == ([0, 0, 0, 0, 5, 6],)
    assert mgr.allocate_slots(b, 10, n, hit) is not None
    b.num_computed_tokens = 34
    assert mgr.get_block_ids("b") == ([0, 0, 0, 0, 5, 6, 8, 9, 10],)
    b.append_output_token_ids(1)
    assert mgr.allocate_slots(b, 1) is not None
    # b's hit point is a boundary that matters (another request reached it): the window before it
    # (ids 5, 6) has left b's window but stays held, so it cannot be evicted piecemeal while b runs.
    assert mgr.get_block_ids("b")[0][4:6] == [5, 6]
    free = mgr.block_pool.free_block_ids()
    assert free[0] == 11 and free[-3:] == [3, 4, 7]
    mgr.free(b)
    # Freed: the partial last block to the front; the windows before the hit point and before the
    # prompt's end (ids 5, 6 and 8, 9) to the tail, oldest first.
    free = mgr.block_pool.free_block_ids()
    assert free[0] == 10 and free[-4:] == [5, 6, 8, 9]
    mgr.check_integrity()


# -- several groups in one allocation --------------------------------------------------------------------


def test_a_group_may_use_the_room_a_later_group_releases() -> None:
    mgr = KVCacheManager(11, BS, specs=[FULL, SW])  # 10 usable blocks
    a = make_request("a", list(range(20)), BS)
    assert mgr.allocate_slots(a, 20) is not None
    a.num_computed_tokens = 20
    assert mgr.get_block_ids("a") == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) and mgr.get_num_free_blocks() == 0
    a.append_output_token_ids(1)
    # Full attention needs a block before the window group has released its old ones: all release first.
    assert mgr.allocate_slots(a, 1) is not None
    # The window group releases blocks 0-1 (ids 6, 7); block 2 is held, being in the window before the
    # prompt's last boundary (where a repeat of this prompt would hit).
    assert mgr.get_block_ids("a") == ([1, 2, 3, 4, 5, 6], [0, 0, 8, 9, 10, 7])
    mgr.check_integrity()


def test_a_group_never_evicts_a_hit_another_group_is_about_to_take() -> None:
    mgr = KVCacheManager(9, BS, specs=[FULL, SW])
    a, c = make_request("a", list(range(8)), BS), make_request("c", list(range(50, 58)), BS)
    assert mgr.allocate_slots(a, 8) is not None and mgr.allocate_slots(c, 8) is not None
    mgr.free(a)
    mgr.free(c)
    # Released unit by unit across groups: what only the 2-block hit needs (full 2, window 4), then
    # what the 1-block hit needs too (full 1, window 3); so a's 1-block hit outlives its 2-block one.
    assert mgr.block_pool.free_block_ids() == [2, 4, 1, 3, 6, 8, 5, 7]
    b = make_request("b", list(range(9)), BS)
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8 and hit.get_block_ids() == ([1, 2], [3, 4])
    assert mgr.allocate_slots(b, 1, n, hit) is not None
    # The hits (1-4) were at the head of the free queue: taken before any allocation.
    assert mgr.get_block_ids("b") == ([1, 2, 6], [3, 4, 8])
    mgr.check_integrity()
