"""Paged attention (with and without cascades over shared prefixes) equals dense causal attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.runner import kernels
from kvpool.runner.attention import AttentionMetadata, SeqAttn, paged_attention
from kvpool.runner.attention_backends import (
    BatchInvariantBackend,
    CpuKernelBackend,
    TorchBackend,
    select_backend,
)

KERNEL = [False, True]  # decode rows through the torch path, then through the compiled kernel

BS, HKV, H, D = 4, 2, 4, 8


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None = None) -> torch.Tensor:
    """Reference: queries at positions start.. over keys 0.. (the last `window` only, when given);
    q (n, H, D), k/v (L, HKV, D)."""
    g = H // HKV
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("nhd,lhd->hnl", q, kk) * D ** -0.5
    qi = torch.arange(q.shape[0])[:, None] + start
    kj = torch.arange(k.shape[0])[None, :]
    s = s.masked_fill(kj > qi, float("-inf"))
    if window is not None:
        s = s.masked_fill(kj <= qi - window, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), vv)


def run_step(seqs: list[tuple[list[int], int, int]], cascade: bool, dtype: torch.dtype = torch.float32,
             window: int | None = None, kernel: bool = False):
    """seqs: (block table, first query position, number of queries); their earlier tokens are cached.
    With a window, block 0 (the null block) holds NaN: a table entry of 0 must never be read."""
    torch.manual_seed(0)
    nb = 1 + max(max(t) for t, _, _ in seqs)
    kc = torch.zeros(HKV, nb, BS, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    # Fill the cache: content is a function of the physical slot, so shared blocks hold shared K/V.
    kc.normal_()
    vc.normal_()
    if window is not None:
        kc[:, 0] = float("nan")
        vc[:, 0] = float("nan")
    qs, ks, vs, slots, metas, refs = [], [], [], [], [], []
    row = 0
    for table, start, n in seqs:
        q = torch.randn(n, H, D, dtype=dtype)
        k = torch.randn(n, HKV, D, dtype=dtype)
        v = torch.randn(n, HKV, D, dtype=dtype)
        pos = torch.arange(start, start + n)
        t = torch.tensor(table)
        slot = t[pos // BS] * BS + pos % BS
        qs.append(q)
        ks.append(k)
        vs.append(v)
        slots.append(slot)
        metas.append(SeqAttn(row, row + n, start + n, t[: -(-(start + n) // BS)]))
        row += n
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), seqs=metas, window=window)
    assert not kernel or kernels.paged_decode_attention() is not None, "the decode kernel did not build"
    # The decode kernel alone (chunks through torch, with cascades), or torch only.
    backend = (CpuKernelBackend(BS, dtype, H // HKV, prefill=False, cascade=cascade, min_cascade_tokens=BS) if kernel
               else TorchBackend(BS, dtype, H // HKV, cascade=cascade, min_cascade_tokens=BS))
    backend.plan(meta)
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), kc, vc, meta, D ** -0.5)
    # Reference over the cache as it is after the write.
    for (table, start, n), m in zip(seqs, metas, strict=True):
        t = torch.tensor(table)
        pos = torch.arange(start + n)
        flat = t[pos // BS].clamp(min=1) * BS + pos % BS  # (null entries are outside the window)
        k_all = kc.view(HKV, -1, D)[:, flat].transpose(0, 1)
        v_all = vc.view(HKV, -1, D)[:, flat].transpose(0, 1)
        refs.append(dense(torch.cat(qs)[m.q_start:m.q_end].float(), k_all.float(), v_all.float(), start, window))
    return out, torch.cat(refs), meta


SHARED = [1, 2, 3, 4]  # 16 tokens of shared prefix
CASES = {
    "decodes sharing a prefix": [([*SHARED, 5, 6], 20, 1), ([*SHARED, 7], 17, 1), ([*SHARED, 8, 9], 22, 1)],
    "prefill chunks after a shared prefix": [([*SHARED, 5, 6], 16, 6), ([*SHARED, 7, 8], 18, 5)],
    "mixed, with an unrelated fresh prefill": [([*SHARED, 5, 6], 16, 7), ([*SHARED, 7], 19, 1),
                                              ([10, 11, 12], 0, 11), ([13, 14], 7, 1)],
    "members diverging inside the shared blocks": [([1, 2, 3, 5], 14, 1), ([1, 2, 6, 7], 13, 1)],
    "shared blocks that are not adjacent ids": [([5, 2, 9, 4, 6], 18, 1), ([5, 2, 9, 4, 7], 17, 3)],
    # Four prefixes in one step, three of one length; groups of 3, 2, 2 and 2 members mixing decodes
    # and chunks.
    "several prefixes in flight": [([1, 2, 3], 10, 1), ([1, 2, 4], 8, 3), ([1, 2, 5], 9, 1),
                                   ([6, 7, 8], 11, 1), ([6, 7, 9], 8, 2),
                                   ([10, 11, 12], 10, 1), ([10, 11, 13], 9, 1),
                                   ([14, 15, 16, 17], 14, 1), ([14, 15, 16, 18], 12, 3)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("kernel", KERNEL)
def test_matches_dense_attention(case: str, cascade: bool, kernel: bool) -> None:
    out, ref, meta = run_step(CASES[case], cascade, kernel=kernel)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The cascade is exact: same result as attending to each sequence's whole context alone.
    plain, _, _ = run_step(CASES[case], False)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
    if kernel:
        # The kernel reads each decode row's whole context: only multi-token chunks form groups.
        assert all(meta.seqs[i].num_queries > 1 for g in meta.groups for i in g.members)
        assert meta.decode_mask is None
    elif cascade and case != "mixed, with an unrelated fresh prefill":
        assert meta.groups, "the shared prefix should have formed a cascade group"
    if cascade and not kernel and case == "several prefixes in flight":
        assert sorted((g.prefix_len, len(g.members)) for g in meta.groups) == [(8, 2), (8, 2), (8, 3), (12, 2)]


def test_cascade_groups_take_only_fully_visible_shared_blocks() -> None:
    _, _, meta = run_step(CASES["members diverging inside the shared blocks"], True)
    assert [g.prefix_len for g in meta.groups] == [2 * BS]
    assert [s.prefix_len for s in meta.seqs] == [8, 8]
    _, _, meta = run_step([([*SHARED, 5], 16, 4), (SHARED, 8, 8)], True)
    # The second sequence's queries start at 8: only blocks 1-2 are visible to all of them.
    assert [g.prefix_len for g in meta.groups] == [8]
    assert meta.groups[0].first_block == 1  # blocks 1, 2: adjacent, read in place
    _, _, meta = run_step(CASES["shared blocks that are not adjacent ids"], True)
    assert meta.groups[0].first_block is None and meta.groups[0].prefix_len == 16  # gathered


@pytest.mark.parametrize("kernel", KERNEL)
def test_bf16_close_to_dense(kernel: bool) -> None:
    out, ref, meta = run_step(CASES["mixed, with an unrelated fresh prefill"], True, torch.bfloat16, kernel=kernel)
    assert bool(meta.groups) != kernel  # the prefix's one other member is a decode row, the kernel's
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)


# Window 6 over blocks of 4: a query at position p sees p-5..p. Table entries of 0 are null blocks the
# window manager released; they must not be read (they hold NaN here).
WINDOW_CASES = {
    "decodes far past the window": [([0, 0, 3, 4, 5], 18, 1), ([0, 0, 11, 7], 13, 1), ([9, 10], 5, 1)],
    "chunk after a window hit": [([0, 2, 3, 4, 5, 6], 12, 9), ([12, 7, 8, 9], 8, 3), ([0, 0, 13, 14, 15], 14, 3)],
    "fresh prefill longer than the window": [([2, 3, 4, 5], 0, 15), ([6, 7], 0, 5)],
    "mixed": [([0, 0, 3, 4, 5], 17, 1), ([6, 7, 8], 0, 11), ([0, 9, 10, 11], 9, 4)],
}


@pytest.mark.parametrize("case", sorted(WINDOW_CASES))
@pytest.mark.parametrize("kernel", KERNEL)
def test_sliding_window_matches_dense(case: str, kernel: bool) -> None:
    out, ref, meta = run_step(WINDOW_CASES[case], cascade=True, window=6, kernel=kernel)
    assert not meta.groups  # no cascades over a window
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_backends_are_chosen_once_from_what_the_runner_allows() -> None:
    kw = dict(block_size=BS, dtype=torch.float32, group_heads=2, cascade=True)
    assert isinstance(select_backend(batch_invariant=True, decode_kernel=False, prefill_kernel=False, **kw),
                      BatchInvariantBackend)
    assert isinstance(select_backend(batch_invariant=False, decode_kernel=False, prefill_kernel=False, **kw),
                      TorchBackend)
    if kernels.paged_decode_attention() is not None:
        b = select_backend(batch_invariant=False, decode_kernel=True, prefill_kernel=False, **kw)
        assert isinstance(b, CpuKernelBackend) and not b.prefill


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU here"))])
def test_cascades_are_on_by_default_on_the_cpu_only(tiny_llama_dir: Path, device: str) -> None:
    from kvpool.runner.model_runner import ModelRunner

    r = ModelRunner(tiny_llama_dir, dtype="float32", block_size=BS, num_blocks=8, device=device)
    assert r.enable_cascade is (device == "cpu") and r.attn_backend.cascade is r.enable_cascade
    forced = ModelRunner(tiny_llama_dir, dtype="float32", block_size=BS, num_blocks=8, device=device,
                         enable_cascade=device != "cpu")
    assert forced.attn_backend.cascade is (device != "cpu")


def test_batch_invariant_backend_equals_dense() -> None:
    seqs = CASES["mixed, with an unrelated fresh prefill"]
    torch.manual_seed(0)
    kc = torch.randn(HKV, 32, BS, D)
    vc = torch.randn(HKV, 32, BS, D)
    row, metas, qs, ks, vs, slots = 0, [], [], [], [], []
    for table, start, n in seqs:
        t = torch.tensor(table)
        pos = torch.arange(start, start + n)
        qs.append(torch.randn(n, H, D))
        ks.append(torch.randn(n, HKV, D))
        vs.append(torch.randn(n, HKV, D))
        slots.append(t[pos // BS] * BS + pos % BS)
        metas.append(SeqAttn(row, row + n, start + n, t[: -(-(start + n) // BS)]))
        row += n
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), seqs=metas)
    inv = BatchInvariantBackend(BS, torch.float32, H // HKV)
    inv.plan(meta)
    got = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), kc, vc, meta, D ** -0.5)
    for (table, start, n), m in zip(seqs, metas, strict=True):
        t = torch.tensor(table)
        pos = torch.arange(start + n)
        flat = t[pos // BS] * BS + pos % BS
        k_all, v_all = kc.view(HKV, -1, D)[:, flat].transpose(0, 1), vc.view(HKV, -1, D)[:, flat].transpose(0, 1)
        want = dense(torch.cat(qs)[m.q_start:m.q_end], k_all, v_all, start)
        torch.testing.assert_close(got[m.q_start:m.q_end], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [*sorted(CASES), *(f"window: {c}" for c in sorted(WINDOW_CASES))])
def test_the_portable_path_of_other_devices_matches_dense_attention(monkeypatch: pytest.MonkeyPatch,
                                                                   case: str) -> None:
    """What a GPU runs where the CPU calls its CPU-only flash op (cascade prefixes and suffixes through
    `attention_lse_math`, other chunks through `masked_chunk_attention`; windows whose null blocks hold
    NaN included), run here, with and without cascades."""
    from kvpool.runner import attention

    calls: list[str] = []

    def no_flash(*args, **kw):
        raise AssertionError("the CPU-only flash op was called off the CPU")

    def spy(name):
        real = getattr(attention, name)

        def wrapped(*args, **kw):
            calls.append(name)
            return real(*args, **kw)
        return wrapped

    monkeypatch.setattr(attention, "_off_cpu", lambda t: True)
    monkeypatch.setattr(attention, "_flash", no_flash)
    for name in ("attention_lse_math", "masked_chunk_attention"):
        monkeypatch.setattr(attention, name, spy(name))
    window = case.startswith("window: ")
    seqs = WINDOW_CASES[case.removeprefix("window: ")] if window else CASES[case]
    for cascade in (True, False):
        out, ref, meta = run_step(seqs, cascade, window=6 if window else None)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        if not cascade and any(1 < s.num_queries < s.context_len for s in meta.seqs):
            assert "masked_chunk_attention" in calls  # a chunk over cached keys, outside any cascade
        if cascade and meta.groups:
            assert "attention_lse_math" in calls


def test_the_portable_path_gives_a_fully_masked_row_no_weight() -> None:
    from kvpool.runner.attention import attention_lse_math

    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    bias = torch.zeros(3, 5)
    bias[1] = float("-inf")
    o, lse = attention_lse_math(q, k, v, 0.5, bias)
    assert torch.equal(o[0, :, 1], torch.zeros(2, 8)) and bool((lse[0, :, 1] == float("-inf")).all())
    assert torch.isfinite(o).all() and torch.isfinite(lse[0, :, [0, 2]]).all()


@pytest.mark.parametrize("window", [None, 5])
def test_a_chunk_outside_cascades_off_the_cpu_equals_the_cpu_path(window: int | None) -> None:
    """`masked_chunk_attention` (public SDPA, the unrepeated bias) against the CPU's flash op over the
    bias repeated for the folded query heads: same rows, same heads."""
    from kvpool.runner.attention import _flash_lse, masked_chunk_attention

    torch.manual_seed(0)
    n, ctx = 6, 17  # 6 queries at positions 11..16 over 17 keys
    q, k, v = torch.randn(n, H, D), torch.randn(HKV, ctx, D), torch.randn(HKV, ctx, D)
    qi = torch.arange(ctx - n, ctx)[:, None]
    kj = torch.arange(ctx)[None, :]
    hidden = (kj > qi) | ((kj <= qi - window) if window else torch.zeros_like(kj > qi))
    bias = torch.zeros(n, ctx).masked_fill_(hidden, float("-inf"))
    want = _flash_lse(q, k, v, D ** -0.5, bias.repeat(H // HKV, 1))[0]
    torch.testing.assert_close(masked_chunk_attention(q, k, v, D ** -0.5, bias), want, rtol=1e-5, atol=1e-5)
