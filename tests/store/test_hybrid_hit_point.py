"""The store's hit point for models with several layer groups, block by block: what each group needs at a
boundary (all blocks before it, the window before it, the state at it), the largest boundary every group
serves (checked against the KV cache manager's own lookup on random tiers), the read that asks the store
(one EXISTS, one GET of exactly the blocks that point needs) on a real file store, page payloads, and a
fingerprint that changes with the group layout."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvpool.core.block import KVCacheBlock, group_key
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import CrossAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvpool.store import BlockStore, open_store
from kvpool.store.blocks import fingerprint, gather_pages, pages_nbytes, scatter_pages
from kvpool.store.hybrid import FULL, NONE, SLIDING, STATE, HitRule, KVPages, ReadPlan, SlotPages, hit_point

BS = 4
T, F = True, False


def test_each_rule_alone() -> None:
    full, state, none = HitRule(FULL), HitRule(STATE), HitRule(NONE)
    assert hit_point([full], [[T, T, T, F, T]], 5) == 3
    # A window of 2 blocks: blocks 2 and 3 serve boundary 4; 4 is missing, so nothing later works.
    assert hit_point([HitRule(SLIDING, 2)], [[F, F, T, T, F, T]], 6) == 4
    # A prefix shorter than a window needs every block from the first.
    assert hit_point([HitRule(SLIDING, 3)], [[T, T, F, F]], 4) == 2
    assert hit_point([HitRule(SLIDING, 3)], [[F, T, F, F]], 4) == 0
    # A state serves exactly its boundary: the latest one present.
    assert hit_point([state], [[F, T, F, T, F]], 5) == 4
    assert hit_point([none], [[F, F]], 2) == 2  # cross attention never limits a hit
    assert hit_point([full], [[T, T, T]], 2) == 2  # never past the limit


def test_every_group_must_serve_the_point() -> None:
    rules = [HitRule(FULL), HitRule(SLIDING, 3), HitRule(STATE), HitRule(NONE)]
    avail = [[T] * 8 + [F, F],
             [F, F, F, T, T, T, T, T, F, F],
             [F, F, F, F, T, F, T, F, T, F],
             [F] * 10]
    # States at 5, 7 and 9; full attention has 8 blocks; the window [4, 7) is there: 7.
    assert hit_point(rules, avail, 10) == 7
    assert [len(r.needed(7)) for r in rules] == [7, 3, 1, 0]
    assert list(rules[1].needed(7)) == [4, 5, 6] and list(rules[2].needed(7)) == [6]
    avail[1][4] = F  # a hole in the window before 7 (and before 5): no point past 0 works for all
    assert hit_point(rules, avail, 10) == 0
    # What a read past a local hit at 5 may need, within 10 blocks.
    assert [list(r.candidates(5, 10)) for r in rules] == [list(range(10)), list(range(3, 10)),
                                                         list(range(5, 10)), []]


def test_hit_point_agrees_with_the_managers_lookup() -> None:
    """On random device and host contents, the rule the store reads by gives the hit the scheduler's own
    lookup (`_hybrid_hit`) finds: the store never plans a hit one group cannot serve."""
    specs = [FullAttentionSpec(BS), SlidingWindowSpec(BS, sliding_window=9),
             MambaSpec(BS, state_shapes=((3, 2),), state_dtype_bytes=(2,)), SlidingWindowSpec(BS, sliding_window=5)]
    rules = [HitRule.of(s) for s in specs]
    assert [r.window_blocks for r in rules] == [0, 2, 0, 1]
    rng = random.Random(0)
    n = 12
    hashes = [bytes([i]) * 32 for i in range(n)]
    seen = set()
    for trial in range(300):
        kv = KVCacheManager(64, BS, specs=specs, num_host_blocks=64)
        assert kv.host is not None
        dense = rng.random()
        avail = [[rng.random() < dense for _ in range(n)] for _ in specs]
        for g, row in enumerate(avail):
            for i, present in enumerate(row):
                if present:  # device or host: the lookup continues on the host tier
                    where = kv.block_pool.cached if rng.random() < 0.5 else kv.host.pools[0].cached
                    where[group_key(hashes[i], g)] = KVCacheBlock(1000 + trial)
        limit = rng.randrange(n + 1)
        hits, _ = kv._hybrid_hit(hashes, limit)
        want = max(len(h) for h in hits)
        assert hit_point(rules, [r[:limit] for r in avail], limit) == want, (trial, avail, limit)
        seen.add(want)
    assert len(seen) > 4  # the trials reached many different points


def plan(local: list[list[bool]], rules: list[HitRule], limit: int) -> ReadPlan:
    keys = [[group_key(bytes([i]) * 16, g) for i in range(limit)] for g in range(len(rules))]
    return ReadPlan(rules, local, hit_point(rules, local, limit), limit, keys, [0, 1, 1])


def test_the_read_is_costed_by_what_a_hit_at_the_limit_needs() -> None:
    """Not every candidate (each group's blocks that some point could need) but what the point at the limit
    needs and no local tier holds: the full group's missing blocks, the window before it, the one state."""
    rules = [HitRule(FULL), HitRule(SLIDING, 2), HitRule(STATE)]
    local = [[T, T, T, F, F, F, F, F], [F, T, T, F, F, F, F, F], [F, F, T, F, F, F, F, F]]
    p = plan(local, rules, 8)
    assert len(p.candidates()) == 5 + 5 + 5
    assert p.needed_from_store() == 5 + 2 + 1
    assert plan([[T] * 8, [F, F, F, F, F, F, T, T], [T] * 8], rules, 8).needed_from_store() == 0


def test_the_read_asks_once_and_reads_exactly_what_the_point_needs(tmp_path: Path, tiny_llama_dir: Path) -> None:
    rules = [HitRule(FULL), HitRule(SLIDING, 2), HitRule(STATE)]
    n = 8
    local = [[T, T, T, F, F, F, F, F], [F, T, T, F, F, F, F, F], [F, F, T, F, F, F, F, F]]
    p = plan(local, rules, n)
    assert p.local_point == 3
    fp = fingerprint(tiny_llama_dir, [(torch.zeros(1, 1, 1, 1),) * 2], BS)
    store = BlockStore(open_store(f"file://{tmp_path}"), fp)
    # The store has full blocks 3..6, sliding blocks 4..6 and the states at boundaries 5 and 7 (blocks 4
    # and 6); block 7 of the full group is missing, so the best point is 7.
    held = [(0, i) for i in range(3, 7)] + [(1, i) for i in (4, 5, 6)] + [(2, 4), (2, 6)]
    store.put([(p.keys[g][i], f"{g}/{i}".encode()) for g, i in held])
    cands = p.candidates()
    assert len(cands) == 5 + 5 + 5  # full: 3..7; sliding: 2..7 less the local 2; state: 3..7
    before = store.stats.as_dict()
    out = p.job(cands, cands)(store)
    after = store.stats.as_dict()
    # Point 7: full blocks 3..6, sliding 5..6, the state at 7 (block 6, page type 1): 7 blocks, one GET.
    got = {k: v for k, v in zip(cands, out, strict=True) if v is not None}
    want = [(0, i) for i in range(3, 7)] + [(1, 5), (1, 6), (2, 6)]
    assert set(got) == {p.keys[g][i] for g, i in want}
    assert got[p.keys[2][6]] == (1, 2, b"2/6") and got[p.keys[0][3]] == (0, 0, b"0/3")
    assert after["round_trips"] - before["round_trips"] == 2  # one EXISTS, one GET
    assert after["lookups"] - before["lookups"] == 7 and after["hits"] - before["hits"] == 7
    # Keys another request's read owns are not read twice: here, the full group's.
    mine = [k for k in cands if k not in p.keys[0]]
    out = p.job(cands, mine)(store)
    assert sum(v is not None for v in out) == 3
    # Nothing past the local hit in the store: no GET at all.
    empty = BlockStore(open_store(f"file://{tmp_path}/empty"), store.fp)
    assert p.job(cands, cands)(empty) == [None] * len(cands)
    assert empty.stats.as_dict()["read_calls"] == 0


def test_page_payloads_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    src = [torch.randn((5, 12), generator=g) for _ in range(3)]
    payloads = gather_pages(src, [4, 1])
    assert [len(p) for p in payloads] == [pages_nbytes(src)] * 2 == [3 * 12 * 4] * 2
    dst = [torch.zeros((5, 12)) for _ in range(3)]
    scatter_pages(dst, [0, 2], payloads)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[0], s[4]) and torch.equal(d[2], s[1]) and not d[1].any()
    with pytest.raises(ValueError, match="payload"):
        scatter_pages(dst, [0], [b"short"])


def test_group_layout_is_in_the_fingerprint(tiny_llama_dir: Path) -> None:
    from kvpool.store.hybrid import hybrid_fingerprint

    kv = [(torch.zeros(2, 4, BS, 8), torch.zeros(2, 4, BS, 8))]
    pages = [KVPages(kv)]
    full, sw = FullAttentionSpec(BS, 2, 8, 4), SlidingWindowSpec(BS, 2, 8, 4, sliding_window=24)

    def fp(specs: list, group_of_layer: list[int], tensors: list[int], page_type: list[int] | None = None,
           pgs: list | None = None) -> bytes:
        return hybrid_fingerprint(tiny_llama_dir, torch.float32, BS, specs, group_of_layer, tensors,
                                  page_type or [0] * len(specs), pgs or pages).key(b"h")

    base = fp([sw, full], [0, 1], [0, 0])
    assert base == fp([sw, full], [0, 1], [0, 0])  # deterministic
    assert base != fp([sw, full], [1, 0], [0, 0])  # the same groups over other layers
    assert base != fp([full, sw], [0, 1], [0, 0])  # the groups in another order
    assert base != fp([SlidingWindowSpec(BS, 2, 8, 4, sliding_window=32), full], [0, 1], [0, 0])  # window
    assert base != fp([sw, CrossAttentionSpec(BS, 2, 8, 4)], [0, 1], [0, 0])
    slots = [SlotPages([torch.zeros(4, 64)])]
    assert base != fp([sw, full], [0, 1], [0, 0], [0, 0], slots)  # other page layout
    # Never the single-group key of the same tensors.
    assert base != fingerprint(tiny_llama_dir, kv, BS).key(b"h")
