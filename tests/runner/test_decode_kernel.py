"""The compiled paged decode kernel against a float64 reference, and its refusals of bad input."""

from __future__ import annotations

import pytest
import torch

from kvpool.runner import kernels


@pytest.fixture(scope="module")
def op():
    fn = kernels.paged_decode_attention()
    assert fn is not None, "the kernel must build on this machine (C++ compiler and ninja are dependencies)"
    return fn


def reference(q, kc, vc, tables, lows, lens, scale):
    hkv, _, _, d = kc.shape
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        k = kc[:, tables[b]].reshape(hkv, -1, d)[:, lows[b]:lens[b]].double()
        v = vc[:, tables[b]].reshape(hkv, -1, d)[:, lows[b]:lens[b]].double()
        s = q[b].double().view(hkv, -1, d) @ k.transpose(1, 2) * scale
        out[b] = (torch.softmax(s, -1) @ v).reshape(-1, d)
    return out


def make(dtype, heads, kv_heads, dim, bs, lens, lows, block_major=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens)
    nb = 3 + width * len(lens)
    if block_major:
        # Pages of a pool shared with state layers: (blocks, kv_heads, ...) storage seen head-major.
        kc = torch.randn(nb, kv_heads, bs, dim, generator=g).to(dtype).transpose(0, 1)
        vc = torch.randn(nb, kv_heads, bs, dim, generator=g).to(dtype).transpose(0, 1)
    else:
        kc = torch.randn(kv_heads, nb, bs, dim, generator=g).to(dtype)
        vc = torch.randn(kv_heads, nb, bs, dim, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(lows), torch.tensor(lens)


SHAPES = {
    # (heads, kv_heads, head_dim, block_size, lens, lows)
    "smollm2 shape, bf16 fast path": (9, 3, 64, 16, [1, 15, 16, 17, 100, 333], [0, 0, 0, 0, 0, 0]),
    "window start inside a block": (9, 3, 64, 16, [40, 70, 33], [5, 21, 32]),
    "head_dim 128, blocks of 32": (8, 2, 128, 32, [31, 64, 65, 200], [0, 3, 0, 150]),
    "no GQA, blocks of 4": (4, 4, 64, 4, [3, 9, 30], [0, 2, 0]),
    "head_dim 40 (generic loops)": (6, 2, 40, 8, [7, 25], [0, 9]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("block_major", [False, True])
def test_matches_reference(op, dtype, case, block_major) -> None:
    heads, kv_heads, dim, bs, lens, lows = SHAPES[case]
    q, kc, vc, tables, lo, ln = make(dtype, heads, kv_heads, dim, bs, lens, lows, block_major)
    scale = dim ** -0.5
    out = op(q, kc, vc, tables, lo, ln, scale, torch.empty_like(q))
    ref = reference(q, kc, vc, tables, lo, ln, scale)
    tol = 2e-6 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding (2^-8 relative)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_keys_outside_the_range_are_never_read(op) -> None:
    q, kc, vc, tables, lo, ln = make(torch.bfloat16, 9, 3, 64, 16, [50], [20])
    ref = op(q, kc, vc, tables, lo, ln, 0.125, torch.empty_like(q))
    # Poison every key before position 20 and after 50 (blocks 0 and 3, and the dead slots of 1).
    kc2, vc2 = kc.clone(), vc.clone()
    for blk, span in ((0, slice(None)), (1, slice(0, 4)), (3, slice(2, None))):
        kc2[:, tables[0, blk], span] = float("nan")
        vc2[:, tables[0, blk], span] = float("nan")
    out = op(q, kc2, vc2, tables, lo, ln, 0.125, torch.empty_like(q))
    assert torch.equal(out, ref)


def test_refuses_bad_input(op) -> None:
    q, kc, vc, tables, lo, ln = make(torch.float32, 4, 2, 64, 16, [20], [0])
    with pytest.raises(RuntimeError, match="block id 99 is outside the cache's"):
        op(q, kc, vc, torch.tensor([[tables[0, 0], 99]]), lo, ln, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match=r"keys \[0, 40\) do not fit its 2 blocks"):
        op(q, kc, vc, tables, lo, torch.tensor([40]), 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match=r"keys \[20, 20\)"):
        op(q, kc, vc, tables, torch.tensor([20]), ln, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="share one dtype"):
        op(q, kc.bfloat16(), vc.bfloat16(), tables, lo, ln, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="float32 and bfloat16 only"):
        op(q.half(), kc.half(), vc.half(), tables, lo, ln, 1.0, torch.empty_like(q.half()))
    with pytest.raises(RuntimeError, match="heads / kv_heads"):
        op(q[:, :3].contiguous(), kc, vc, tables, lo, ln, 1.0, torch.empty_like(q[:, :3]))
    with pytest.raises(RuntimeError, match="heads / kv_heads"):  # no kv head: a division by zero before
        op(q, kc[:0], vc[:0], tables, lo, ln, 1.0, torch.empty_like(q))


@pytest.mark.parametrize(("dim", "bs", "group"), [(64, 16, 3), (128, 32, 4), (40, 8, 2)])
def test_fp32_grouped_decode_is_a_row_for_row_equal_of_another_kernel(op, dim, bs, group) -> None:
    # Two groups whose members share their first blocks (3 and 2 of them), and one sequence alone: the
    # grouped op reads the shared keys once per group, with each row's arithmetic unchanged: where the fp32
    # prompt kernel runs (AVX2, head_dim 64/128/256) it is that kernel's, so a decode row equals its query
    # computed as a one-query prompt chunk bit for bit (a token decoded or recomputed after a preemption:
    # the same numbers); elsewhere it is the ungrouped decode kernel's. And the float64 reference to fp32
    # rounding.
    kernels.paged_decode_attention()  # loads the library that holds paged_decode_grouped
    g = torch.Generator().manual_seed(1)
    kv_heads, nb = 2, 64
    kc = torch.randn(kv_heads, nb, bs, dim, generator=g)
    vc = torch.randn(kv_heads, nb, bs, dim, generator=g)
    free = iter(torch.randperm(nb, generator=g).tolist())
    shared = [[next(free) for _ in range(3)], [next(free) for _ in range(2)], []]
    members = [(0, [3 * bs + 1, 4 * bs, 3 * bs + 7 + bs]), (1, [2 * bs + 5, 2 * bs + 1]), (2, [bs + 3])]
    tables, lens = [], []
    for gi, ns in members:
        for n in ns:
            own = -(-n // bs) - len(shared[gi])
            tables.append(shared[gi] + [next(free) for _ in range(own)])
            lens.append(n)
    width = max(map(len, tables))
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens_t = torch.tensor(lens)
    n_rows = len(lens) + 2  # two rows of q that are not decode rows: the op must leave them alone
    q = torch.randn(n_rows, kv_heads * group, dim, generator=g)
    rows = torch.tensor([5, 0, 2, 6, 3, 1])
    starts = torch.tensor([0, 3, 5, 6])
    shared_keys = torch.tensor([3 * bs, 2 * bs, 0])
    scale = dim ** -0.5
    out = torch.full_like(q, 7.0)
    torch.ops.kvpool.paged_decode_grouped(q, kc, vc, rows, tables_t, lens_t, starts, shared_keys, scale, out)
    if kernels.prefill_supported(dim, bs, torch.float32):
        b = len(lens)
        want = kernels.paged_prefill_attention()(q[rows], kc, vc, torch.arange(b), torch.ones(b, dtype=torch.long),
                                                 lens_t, tables_t, 0, scale, torch.empty_like(q[rows]))
    else:
        want = op(q[rows], kc, vc, tables_t, torch.zeros_like(lens_t), lens_t, scale, torch.empty_like(q[rows]))
    assert torch.equal(out[rows], want)
    assert torch.equal(out[[4, 7]], torch.full_like(out[[4, 7]], 7.0))
    ref = reference(q[rows], kc, vc, tables_t, torch.zeros_like(lens_t), lens_t, scale)
    torch.testing.assert_close(out[rows].double(), ref, rtol=2e-6, atol=2e-6)


def test_fp32_grouped_decode_refuses_a_member_that_does_not_share_the_blocks(op) -> None:
    q, kc, vc, tables, _, ln = make(torch.float32, 4, 2, 64, 16, [40, 40], [0, 0])
    with pytest.raises(RuntimeError, match="sequence 1 does not share block 0"):
        torch.ops.kvpool.paged_decode_grouped(q, kc, vc, torch.tensor([0, 1]), tables, ln, torch.tensor([0, 2]),
                                              torch.tensor([16]), 0.125, torch.empty_like(q))
    q, kc, vc, tables, _, ln = make(torch.float32, 4, 2, 40, 16, [40, 40], [0, 0])  # head_dim 40: decode loops only
    with pytest.raises(RuntimeError, match="packed layout need AVX2 and FMA, head_dim 64, 128 or 256"):
        torch.ops.kvpool.paged_decode_grouped(q, kc, vc, torch.tensor([0, 1]), tables, ln, torch.tensor([0, 1, 2]),
                                              torch.tensor([0, 0]), 0.125, torch.empty_like(q), True)
