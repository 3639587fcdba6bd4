"""The omni seed's worked examples on the stage-output cache, driven by the real KV cache manager.

8 blocks of 4 tokens (kvpool's block 0 is the null block, so the seed's block i is kvpool's i + 1),
hidden size 2 and a 16-wide `mm_feature`. A stand-in "model" makes every token's outputs depend on
the token and everything before it (as a causal model's do), so "cached rows + computed rows" can be
compared exactly with computing the whole request.
"""

from __future__ import annotations

import pytest
import torch
from helpers import Words, make_request, schedule, snapshot

from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.request import MultiModalItem
from kvpool.runner.stage_output_cache import StageOutputCache

BS = 4


def model_outputs(inputs: list[float]) -> dict[str, torch.Tensor]:
    """Per-token outputs of a causal stand-in: row i depends on inputs[0..i]. Plus a pooled vector,
    which is not per-token and must not be cached."""
    x = torch.tensor(inputs, dtype=torch.float64)
    c = torch.cumsum(x * torch.arange(1, len(inputs) + 1), 0)
    hidden = torch.stack([c, x * 0.5 + c], dim=1).float()  # (n, 2)
    mm_feature = (c[:, None] * torch.linspace(-1, 1, 16)[None]).to(torch.bfloat16)  # (n, 16)
    return {"hidden_states": hidden, "mm_feature": mm_feature, "pooled": torch.ones(2, 5)}


def run_step(cache: StageOutputCache, mgr: KVCacheManager, req_id: str, inputs: list[float], n_hit: int
             ) -> dict[str, torch.Tensor]:
    """What the runner and the engine do for one request: compute the tokens after the hit, store
    their rows at the request's slots, and return hit rows + computed rows."""
    table = mgr.get_block_ids(req_id)[0]
    computed = {k: v[n_hit:] if v.shape[0] == len(inputs) else v for k, v in model_outputs(inputs).items()}
    # The runner computes only tokens [n_hit, n): their outputs depend on the prefix through the KV cache.
    assert cache.write(computed, cache.slots(table, n_hit, len(inputs))) == ["hidden_states", "mm_feature"]
    hit = cache.read(table, 0, n_hit)
    return {k: torch.cat([hit[k], computed[k]]) for k in hit}


def test_quick_brown_fox(words: Words) -> None:
    mgr = KVCacheManager(num_blocks=9, block_size=BS)
    cache = StageOutputCache(num_blocks=9, block_size=BS)
    t1 = words("The quick brown fox was tired and slept beneath the shady tree")
    r1 = make_request("r1", t1, BS)
    assert schedule(mgr, r1) is not None
    assert mgr.get_block_ids("r1") == ([1, 2, 3],)
    assert cache.slots([1, 2, 3], 0, 12).tolist() == list(range(4, 16))
    out1 = run_step(cache, mgr, "r1", [float(t) for t in t1], 0)
    # Discovered at run time: one tensor per per-token output, each with its own width and dtype.
    assert {k: (tuple(v.shape), v.dtype) for k, v in cache.tensors.items()} == {
        "hidden_states": ((9, 4, 2), torch.float32), "mm_feature": ((9, 4, 16), torch.bfloat16)}
    assert torch.equal(cache.tensors["hidden_states"][1:4].reshape(12, 2), out1["hidden_states"])
    assert torch.equal(cache.tensors["mm_feature"].view(-1, 16)[4:16], out1["mm_feature"])
    assert not cache.tensors["hidden_states"][4:].any()  # the seed's blocks 3..7: empty
    mgr.free(r1)

    t2 = words("The quick brown fox jumped over the dog")
    r2 = make_request("r2", t2, BS)
    hit, n_hit = mgr.get_computed_blocks(r2)
    assert n_hit == 4 and hit.get_block_ids() == ([1],)
    assert mgr.allocate_slots(r2, len(t2) - n_hit, n_hit, hit).get_block_ids() == ([4],)
    before = {k: v.clone() for k, v in cache.tensors.items()}
    out2 = run_step(cache, mgr, "r2", [float(t) for t in t2], n_hit)
    # Block 1's rows are reused (read, not written); block 4 (the seed's block 3) is written.
    assert torch.equal(out2["hidden_states"][:4], out1["hidden_states"][:4])
    full = model_outputs([float(t) for t in t2])
    for k in ("hidden_states", "mm_feature"):
        assert torch.equal(out2[k], full[k])  # what computing the whole request gives
        assert torch.equal(cache.tensors[k][[1, 2, 3]], before[k][[1, 2, 3]])
        assert torch.equal(cache.tensors[k][4], full[k][4:8])
    assert cache.rows_read == 4 and cache.rows_written == 12 + 4


def _image_request(rid: str, image: str, text: list[int]) -> tuple[list[int], list[float], MultiModalItem]:
    placeholder = 7
    tokens = [placeholder] * 6 + text
    # What the model sees: the image's features at its placeholders, token embeddings elsewhere.
    feats = [hash((image, i)) % 97 / 7.0 for i in range(6)] + [float(t) for t in text]
    return tokens, feats, MultiModalItem(image, 0, 6)


def test_image_straddling_a_block() -> None:
    mgr = KVCacheManager(num_blocks=9, block_size=BS)
    cache = StageOutputCache(num_blocks=9, block_size=BS)
    tok1, in1, item = _image_request("r1", "img-A", [201])  # [Im0..Im3] [Im4 Im5 foo <empty>]
    r1 = make_request("r1", tok1, BS, mm_items=[item])
    schedule(mgr, r1)
    assert mgr.get_block_ids("r1") == ([1, 2],)
    run_step(cache, mgr, "r1", in1, 0)
    assert len(r1.block_hashes) == 1  # only the full block is hashed, so only it can be a hit
    mgr.free(r1)

    tok2, in2, item = _image_request("r2", "img-A", [202, 203])  # [Im0..Im3] [Im4 Im5 bar baz]
    r2 = make_request("r2", tok2, BS, mm_items=[item])
    hit, n_hit = mgr.get_computed_blocks(r2)
    assert n_hit == 4 and hit.get_block_ids() == ([1],)
    # r1's partial block 2 held nothing cached: it is reused first, and its rows are overwritten.
    assert mgr.allocate_slots(r2, len(tok2) - n_hit, n_hit, hit).get_block_ids() == ([2],)
    out2 = run_step(cache, mgr, "r2", in2, n_hit)
    full = model_outputs(in2)
    for k in ("hidden_states", "mm_feature"):
        assert torch.equal(out2[k], full[k])
        assert torch.equal(cache.tensors[k][2], full[k][4:8])

    # Same placeholder tokens, another image: the block hash differs, no hit, nothing read.
    tok3, _, item3 = _image_request("r3", "img-B", [202, 203])
    assert tok3 == tok2
    r3 = make_request("r3", tok3, BS, mm_items=[item3])
    assert mgr.get_computed_blocks(r3)[1] == 0


def test_rows_follow_blocks_through_the_host_tier() -> None:
    # Device pool of 4 usable blocks, host tier of 4. r1's full blocks are sheltered on eviction and
    # come back into other device blocks: their rows must come back with them.
    mgr = KVCacheManager(num_blocks=5, block_size=BS, num_host_blocks=4)
    cache = StageOutputCache(num_blocks=5, block_size=BS, num_host_blocks=4)
    t1 = [float(i) for i in range(10, 19)]  # 9 tokens: 2 full blocks + 1
    r1 = make_request("r1", [int(t) for t in t1], BS)
    schedule(mgr, r1)
    assert mgr.get_block_ids("r1") == ([1, 2, 3],)
    cache.apply_swaps(mgr.end_schedule_step())
    out1 = run_step(cache, mgr, "r1", t1, 0)
    mgr.free(r1)

    filler = make_request("f", list(range(100, 116)), BS)  # 4 blocks: evicts r1's cached 1 and 2
    schedule(mgr, filler)
    plan = mgr.end_schedule_step()
    assert sorted(d for d, _ in plan.swap_out) == [1, 2]
    cache.apply_swaps(plan)  # before the forward that overwrites those blocks
    run_step(cache, mgr, "f", [float(t) for t in range(100, 116)], 0)
    mgr.free(filler)
    other = make_request("g", [300], BS)  # takes the head of the free queue: r1's first block id
    schedule(mgr, other)
    assert mgr.get_block_ids("g") == ([1],)

    r1b = make_request("r1b", [int(t) for t in t1], BS)
    hit, n_hit = mgr.get_computed_blocks(r1b)
    assert n_hit == 8 and len(hit.host_blocks) == 2
    state = snapshot(mgr)
    assert mgr.allocate_slots(r1b, len(t1) - n_hit, n_hit, hit) is not None
    assert snapshot(mgr) != state
    plan = mgr.end_schedule_step()
    table = mgr.get_block_ids("r1b")[0]
    assert [d for _, d in plan.swap_in] == table[:2] and 1 not in table[:2]
    stale = cache.read(table, 0, 8)["hidden_states"]
    assert not torch.equal(stale, out1["hidden_states"][:8])  # without the copy: the filler's rows
    cache.apply_swaps(plan)
    out = run_step(cache, mgr, "r1b", t1, n_hit)
    assert torch.equal(out["hidden_states"], out1["hidden_states"])
    assert torch.equal(out["mm_feature"], out1["mm_feature"])


def test_a_name_changing_width_is_refused() -> None:
    cache = StageOutputCache(num_blocks=3, block_size=BS)
    slots = cache.slots([1], 0, 2)
    cache.write({"h": torch.zeros(2, 3)}, slots)
    with pytest.raises(ValueError, match=r"stage output 'h': shape \(4,\)/torch.float32 per token, but the cache "
                                         r"holds \(3,\)/torch.float32"):
        cache.write({"h": torch.zeros(2, 4)}, slots)
    with pytest.raises(ValueError, match=r"positions \[0, 5\) do not fit a table of 1 blocks"):
        cache.slots([1], 0, 5)
