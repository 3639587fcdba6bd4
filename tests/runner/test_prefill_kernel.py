"""The compiled paged prefill (flash) kernel against a float64 reference, and its refusals of bad input."""

from __future__ import annotations

import pytest
import torch

from kvpool.runner import kernels
from kvpool.runner.dtypes import indexable, round_to


@pytest.fixture(scope="module")
def op():
    assert kernels.paged_prefill_attention() is not None, "the kernels must build on this machine"
    if not kernels.prefill_supported(64, 16):
        pytest.skip("this CPU has no AVX-512 BF16: the prefill kernel is not used here")
    return kernels.paged_prefill_attention()


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Per dtype: elementwise and mean absolute tolerance against the float64 reference. bf16 outputs (and bf16
# probabilities in the value product, as PyTorch's CPU flash kernel rounds them); fp32 sums throughout.
TOLERANCE = {torch.bfloat16: (2e-2, 2e-3), torch.float32: (2e-5, 1e-6)}


@pytest.fixture(scope="module", params=sorted(DTYPES))
def dtype(request) -> torch.dtype:
    """The prompt kernel's dtypes this CPU runs: bf16 with AVX-512 BF16, fp32 with AVX2 and FMA."""
    assert kernels.paged_prefill_attention() is not None, "the kernels must build on this machine"
    dt = DTYPES[request.param]
    if not kernels.prefill_supported(64, 16, dt):
        pytest.skip(f"this CPU lacks what the {request.param} prefill kernel needs")
    return dt


def reference(q, kc, vc, seqs, tables, window, scale):
    """Dense causal (windowed) attention per sequence in float64, over the cache read through its table."""
    hkv, _, _, d = kc.shape
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    for (start, n, ctx), table in zip(seqs, tables, strict=True):
        k = kc[:, table].reshape(hkv, -1, d)[:, :ctx].double()
        v = vc[:, table].reshape(hkv, -1, d)[:, :ctx].double()
        qq = q[start:start + n].double().view(n, hkv, -1, d).permute(1, 2, 0, 3)  # (hkv, g, n, d)
        s = torch.einsum("hgnd,hld->hgnl", qq, k) * scale
        qpos = torch.arange(ctx - n, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        hidden = kpos > qpos
        if window:
            hidden |= kpos <= qpos - window
        s = s.masked_fill(hidden, float("-inf"))
        # Keys outside every query's view may hold NaN (unused slots, released blocks): never read them.
        o = torch.einsum("hgnl,hld->hgnd", torch.softmax(s, -1), torch.nan_to_num(v))
        out[start:start + n] = o.permute(2, 0, 1, 3).reshape(n, -1, d)
    return out


def scenario(seqs, heads=9, kv_heads=3, dim=64, bs=16, window=0, block_major=False, seed=0, dtype=torch.bfloat16):
    """seqs: (number of queries, context length) each; their rows follow one another in q. Every block a
    sequence does not read (unused slots after its context; blocks wholly before its window, left as
    the null block 0) holds NaN."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-ctx // bs) for _, ctx in seqs]
    nb = 1 + sum(widths)
    shape = (nb, kv_heads, bs, dim) if block_major else (kv_heads, nb, bs, dim)
    kc = torch.randn(shape, generator=g).to(dtype)
    vc = torch.randn(shape, generator=g).to(dtype)
    if block_major:
        kc, vc = kc.transpose(0, 1), vc.transpose(0, 1)
    perm = (1 + torch.randperm(nb - 1, generator=g)).tolist()
    tables, rows, start = [], [], 0
    for (n, ctx), w in zip(seqs, widths, strict=True):
        t = [perm.pop() for _ in range(w)]
        if window:
            first_seen = max(0, ctx - n - window + 1) // bs
            t[:first_seen] = [0] * first_seen
        last = t[-1]
        kc[:, last, ctx - (w - 1) * bs:] = float("nan")
        vc[:, last, ctx - (w - 1) * bs:] = float("nan")
        tables.append(t)
        rows.append((start, n, ctx))
        start += n
    kc[:, 0] = float("nan")
    vc[:, 0] = float("nan")
    q = torch.randn(start, heads, dim, generator=g).to(dtype)
    width = max(widths)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    args = [torch.tensor([r[i] for r in rows]) for i in range(3)]
    return q, kc, vc, rows, tables, args, padded


CASES = {
    "fresh prompt": dict(seqs=[(50, 50)]),
    "chunk after cached context": dict(seqs=[(37, 100)]),
    "several sequences, tiles of one and many queries": dict(seqs=[(2, 40), (70, 70), (21, 333), (5, 16)]),
    "sliding window, released blocks before it": dict(seqs=[(40, 90), (30, 30), (3, 77)], window=24),
    "head_dim 128, blocks of 32, group of 8": dict(seqs=[(33, 80), (64, 64)], heads=16, kv_heads=2, dim=128, bs=32),
    "head_dim 256 (Gemma-3), group of 4": dict(seqs=[(30, 90), (7, 7), (2, 41)], heads=4, kv_heads=1, dim=256),
    "head_dim 256, sliding window": dict(seqs=[(29, 100), (17, 17)], heads=4, kv_heads=1, dim=256, window=40),
    "no GQA": dict(seqs=[(19, 50)], heads=4, kv_heads=4),
    "block-major pages": dict(seqs=[(30, 61), (9, 9)], block_major=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(dtype, case: str) -> None:
    kw = CASES[case]
    q, kc, vc, rows, tables, args, padded = scenario(**kw, dtype=dtype)
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    kernels.paged_prefill_attention()(q, kc, vc, *args, padded, kw.get("window", 0), scale, out)
    ref = reference(q, kc, vc, rows, tables, kw.get("window", 0), scale)
    assert not out.isnan().any()
    tol, mean_tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    assert (out.double() - ref).abs().mean() < mean_tol


@pytest.mark.parametrize("window", [0, 24])
def test_rows_do_not_depend_on_the_chunking(dtype, window: int) -> None:
    # One sequence's last 70 queries (of 100 keys) in one call, and as chunks of 13, 37 and 20 calls of their
    # own (a prompt computed in pieces, or after a prefix hit): every output bit the same. This is what keeps
    # greedy tokens identical with prefix caching or chunked prefill on or off.
    q, kc, vc, _, _, (starts, lens, ctx), tables = scenario([(70, 100)], window=window, dtype=dtype)
    op = kernels.paged_prefill_attention()
    whole = op(q, kc, vc, starts, lens, ctx, tables, window, 0.125, torch.empty_like(q))
    pieces = torch.full_like(q, float("nan"))
    done = 0
    for n in (13, 37, 20):
        end = 30 + done + n  # keys of the sequence so far: its 30 cached and the queries up to this chunk's last
        op(q, kc, vc, torch.tensor([done]), torch.tensor([n]), torch.tensor([end]), tables, window, 0.125, pieces)
        done += n
    assert not whole.isnan().any() and torch.equal(whole, pieces)


def test_rows_of_other_sequences_untouched(dtype) -> None:
    q, kc, vc, _, _, args, padded = scenario([(10, 30), (6, 6)], dtype=dtype)
    out = torch.full_like(q, 7.0)
    # Only the second sequence: rows 10..15.
    kernels.paged_prefill_attention()(q, kc, vc, *(a[1:] for a in args), padded[1:], 0, 0.125, out)
    assert (out[:10] == 7.0).all() and not (out[10:] == 7.0).any()


def test_fp32_refuses_what_it_cannot_run() -> None:
    if not kernels.prefill_supported(64, 16, torch.float32):
        pytest.skip("this CPU has no AVX2 and FMA: the fp32 prefill kernel is not used here")
    op = kernels.paged_prefill_attention()
    q, kc, vc, _, _, (starts, lens, ctx), tables = scenario([(10, 30)], dtype=torch.float32)
    assert not kernels.prefill_supported(64, 512, torch.float32)  # (the op refuses blocks over 256)
    with pytest.raises(RuntimeError, match="block_size a multiple of 8"):
        small = kc.view(kc.shape[0], -1, 4, kc.shape[-1])
        op(q, small, small, starts, lens, ctx, tables, 0, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="head_dim 64, 128 or 256"):
        op(q[..., :32].contiguous(), kc[..., :32].contiguous(), vc[..., :32].contiguous(), starts, lens, ctx, tables,
           0, 1.0, torch.empty_like(q[..., :32]))
    with pytest.raises(RuntimeError, match="packed caches must have each block's tokens contiguous"):
        op(q, kc.transpose(0, 1).contiguous().transpose(0, 1), vc.transpose(0, 1).contiguous().transpose(0, 1),
           starts, lens, ctx, tables, 0, 1.0, torch.empty_like(q), True)
    # 16-bit and fp8 caches are read under fp32 queries (a narrower KV cache); float64 ones, or two dtypes,
    # are not.
    for k, v in ((kc.double(), vc.double()), (kc.bfloat16(), vc)):
        with pytest.raises(RuntimeError, match=r"k_cache and v_cache must share one Float \(or, under float32 "
                                               r"queries, bfloat16, float16 or fp8\)"):
            op(q, k, v, starts, lens, ctx, tables, 0, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="block id 99 is outside the cache's"):
        op(q, kc, vc, starts, lens, ctx, torch.tensor([[int(tables[0, 0]), 99]]), 0, 1.0, torch.empty_like(q))


def test_refuses_bad_input(op) -> None:
    q, kc, vc, _, _, (starts, lens, ctx), tables = scenario([(10, 30)])
    # (float32 queries over bf16 caches are a narrow KV cache, which the fp32 kernel takes: see
    # test_fp32_refuses_what_it_cannot_run.)
    with pytest.raises(RuntimeError, match="k_cache and v_cache must share one Float"):
        op(q.float(), kc.double(), vc.double(), starts, lens, ctx, tables, 0, 1.0, torch.empty_like(q.float()))
    with pytest.raises(RuntimeError, match="q must be a contiguous BFloat16"):
        op(q.half(), kc.half(), vc.half(), starts, lens, ctx, tables, 0, 1.0, torch.empty_like(q.half()))
    with pytest.raises(RuntimeError, match="block id 99 is outside the cache's"):
        op(q, kc, vc, starts, lens, ctx, torch.tensor([[int(tables[0, 0]), 99]]), 0, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match=r"10 rows from row 5 are not in q's 10 rows"):
        op(q, kc, vc, torch.tensor([5]), lens, ctx, tables, 0, 1.0, torch.empty_like(q))
    # A start near 2^63 wrapped the sum past the check, and the kernel wrote far outside q.
    with pytest.raises(RuntimeError, match=r"10 rows from row 9223372036854775806 are not in q's 10 rows"):
        op(q, kc, vc, torch.tensor([2**63 - 2]), lens, ctx, tables, 0, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match=r"window must be >= 0 \(0: none\), got -5"):
        op(q, kc, vc, starts, lens, ctx, tables, -5, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="heads / kv_heads"):  # no kv head: a division by zero before
        op(q, kc[:0], vc[:0], starts, lens, ctx, tables, 0, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="10 queries and 40 keys do not fit its 2 blocks"):
        op(q, kc, vc, starts, lens, torch.tensor([40]), tables, 0, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="block_size a multiple of 16"):
        small = kc.view(kc.shape[0], -1, 8, kc.shape[-1])
        op(q, small, small, starts, lens, ctx, tables, 0, 1.0, torch.empty_like(q))


def grouped_scenario(groups, heads=9, kv_heads=3, dim=64, bs=16, seed=3, dtype=torch.bfloat16):
    """groups: (shared blocks, [context lengths]) each; members share their first blocks physically."""
    g = torch.Generator().manual_seed(seed)
    lens = [n for _, ns in groups for n in ns]
    width = max(-(-n // bs) for n in lens)
    nb = 1 + width * len(lens) + sum(sh for sh, _ in groups)
    kc = torch.randn(kv_heads, nb, bs, dim, generator=g).to(dtype)
    vc = torch.randn(kv_heads, nb, bs, dim, generator=g).to(dtype)
    free = (1 + torch.randperm(nb - 1, generator=g)).tolist()
    tables, starts, shared = [], [0], []
    for sh, ns in groups:
        common = [free.pop() for _ in range(sh)]
        for n in ns:
            own = [free.pop() for _ in range(-(-n // bs) - sh)]
            tables.append(common + own + [0] * (width - sh - len(own)))
            kc[:, tables[-1][(n - 1) // bs], (n - 1) % bs + 1:] = float("nan")  # unused slots
            vc[:, tables[-1][(n - 1) // bs], (n - 1) % bs + 1:] = float("nan")
        starts.append(starts[-1] + len(ns))
        shared.append(sh * bs)
    kc[:, 0] = float("nan")
    vc[:, 0] = float("nan")
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    return q, kc, vc, torch.tensor(tables), torch.tensor(lens), torch.tensor(starts), torch.tensor(shared)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 1, 256)])
def test_grouped_decode_matches_reference(op, heads: int, kv_heads: int, dim: int) -> None:
    # Groups of 3, 1 (nothing shared) and 40 (more rows than one task holds: split across tasks).
    q, kc, vc, tables, lens, starts, shared = grouped_scenario(
        [(2, [40, 33, 64]), (0, [20]), (4, [65 + i for i in range(40)])], heads=heads, kv_heads=kv_heads, dim=dim)
    # The decode rows sit among other rows of the step (a prompt chunk's), in another order: the kernel reads
    # and writes only theirs.
    b = q.shape[0]
    row_of = (torch.randperm(b + 5, generator=torch.Generator().manual_seed(1))[:b]).long()
    q_step = torch.randn(b + 5, *q.shape[1:]).to(torch.bfloat16)
    q_step[row_of] = q
    out = torch.full_like(q_step, float("nan"))
    torch.ops.kvpool.paged_decode_grouped(q_step, kc, vc, row_of, tables, lens, starts, shared, 0.125, out)
    rows = [(i, 1, int(n)) for i, n in enumerate(lens)]
    ref = reference(q, kc, vc, rows, [t[: -(-int(n) // 16)].tolist() for t, n in zip(tables, lens, strict=True)],
                    0, 0.125)
    others = torch.ones(b + 5, dtype=torch.bool)
    others[row_of] = False
    assert out[others].isnan().all()  # rows that are not decode rows: untouched
    got = out[row_of]
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-2)
    assert (got.double() - ref).abs().mean() < 2e-3


def test_grouped_decode_refuses_groups_that_share_nothing(op) -> None:
    q, kc, vc, tables, lens, starts, shared = grouped_scenario([(2, [40, 33])])
    rows = torch.arange(2)
    with pytest.raises(RuntimeError, match="sequence 1: row 7 is not in q's 2 rows"):
        torch.ops.kvpool.paged_decode_grouped(q, kc, vc, torch.tensor([0, 7]), tables, lens, starts, shared, 1.0,
                                              torch.empty_like(q))
    bad = tables.clone()
    bad[1, 1] = bad[1, 2]
    with pytest.raises(RuntimeError, match="sequence 1 does not share block 1"):
        torch.ops.kvpool.paged_decode_grouped(q, kc, vc, rows, bad, lens, starts, shared, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="64 shared keys, but sequence 0 has 40"):
        torch.ops.kvpool.paged_decode_grouped(q, kc, vc, rows, tables, lens, starts, torch.tensor([64]), 1.0,
                                              torch.empty_like(q))
    with pytest.raises(RuntimeError, match="group_starts must run from 0 to B"):
        torch.ops.kvpool.paged_decode_grouped(q, kc, vc, rows, tables, lens, torch.tensor([0, 1]), torch.tensor([0]),
                                              1.0, torch.empty_like(q))
    # A middle start past B was used as an index into lens and tables before any check.
    with pytest.raises(RuntimeError, match="group_starts must increase: group 1 is empty"):
        torch.ops.kvpool.paged_decode_grouped(q, kc, vc, rows, tables, lens, torch.tensor([0, 9, 2]),
                                              torch.tensor([0, 0]), 1.0, torch.empty_like(q))


def test_write_kv_matches_index_copy() -> None:
    assert kernels.fused_ops() is not None, "the kernels must build on this machine"  # any CPU: no AVX-512 needed
    # Strided k/v (views of a fused qkv projection), as the model hands them over.
    g = torch.Generator().manual_seed(5)
    kv_heads, nb, bs, dim, t = 3, 9, 16, 64, 21
    qkv = torch.randn(t, 9 * dim + 2 * kv_heads * dim, generator=g).to(torch.bfloat16)
    k = qkv[:, 9 * dim:9 * dim + kv_heads * dim].view(t, kv_heads, dim)
    v = qkv[:, 9 * dim + kv_heads * dim:].view(t, kv_heads, dim)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    kc = torch.zeros(kv_heads, nb, bs, dim, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    torch.ops.kvpool.write_kv(k, v, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    kr.view(kv_heads, nb * bs, dim).index_copy_(1, slots, k.transpose(0, 1))
    vr.view(kv_heads, nb * bs, dim).index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    with pytest.raises(RuntimeError, match=r"token 0: slot 144 is outside the cache's 144 slots"):
        torch.ops.kvpool.write_kv(k[:1], v[:1], kc, vc, torch.tensor([nb * bs]))


def test_packed_caches_give_identical_results(dtype) -> None:
    # The same caches in the kernels' own layout (written once, read in place): bit-identical outputs, for
    # prompt chunks over cached context and for grouped decode rows (unused slots hold NaN in both).
    q, kc, vc, tables, lens, starts, shared = grouped_scenario(
        [(2, [40, 33, 64]), (0, [20]), (4, [65 + i for i in range(40)])], dtype=dtype)
    pk, pv = kernels.packed_layout(kc, vc)
    rows = torch.arange(q.shape[0])
    outs = [torch.ops.kvpool.paged_decode_grouped(q, k, v, rows, tables, lens, starts, shared, 0.125,
                                                  torch.empty_like(q), packed)
            for k, v, packed in ((kc, vc, False), (pk, pv, True))]
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
    # Prompt chunks: 3 sequences with 5, 17 and 30 queries at the end of their contexts, one with a window.
    qs, ql = torch.tensor([0, 5, 22]), torch.tensor([5, 17, 30])
    ctx = lens[:3].clone()
    qp = torch.randn(52, 9, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    op = kernels.paged_prefill_attention()
    for window in (0, 24):
        got = [op(qp, k, v, qs, ql, ctx, tables[:3].contiguous(), window, 0.125, torch.empty_like(qp), packed)
               for k, v, packed in ((kc, vc, False), (pk, pv, True))]
        assert torch.equal(got[0], got[1]) and not got[0].isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_packed_is_the_packed_layout_of_write_kv(dtype) -> None:
    assert kernels.fused_ops() is not None, "the kernels must build on this machine"
    g = torch.Generator().manual_seed(6)
    kv_heads, nb, bs, dim, t = 3, 5, 32, 64, 50
    k = torch.randn(t, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(t, 2 * kv_heads, dim, generator=g).to(dtype)[:, ::2]  # strided heads
    slots = torch.randperm(nb * bs, generator=g)[:t]
    kc = torch.randn(kv_heads, nb, bs, dim, generator=g).to(dtype)
    vc = torch.randn(kv_heads, nb, bs, dim, generator=g).to(dtype)
    pk, pv = kernels.packed_layout(kc, vc)
    torch.ops.kvpool.write_kv(k, v, kc, vc, slots)
    torch.ops.kvpool.write_kv_packed(k, v, pk, pv, slots)
    want_k, want_v = kernels.packed_layout(kc, vc)
    assert torch.equal(pk, want_k) and torch.equal(pv, want_v)


NARROW = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_fp32_queries_over_narrow_caches_are_the_fp32_kernel_over_the_widened_caches(kv_dtype) -> None:
    """A 16-bit or fp8 KV cache under an fp32 model (`kv_cache_dtype`): every load widens 8 elements to fp32
    exactly (e4m3's subnormals among them: 1% of normal draws fall below 2^-6), so the outputs are bit for
    bit those of fp32 caches holding the same (rounded) values, for prompt chunks (with and without a
    window) and grouped decode rows, standard and packed layouts."""
    if not kernels.prefill_supported(64, 16, torch.float32):
        pytest.skip("this CPU lacks what the fp32 prefill kernel needs")
    q, kc, vc, tables, lens, starts, shared = grouped_scenario(
        [(2, [40, 33, 64]), (0, [20]), (4, [65 + i for i in range(40)])], dtype=kv_dtype)
    q = q.float()
    wide = (kc.float(), vc.float())
    layouts = {"standard": ((kc, vc), wide), "packed": (kernels.packed_layout(kc, vc, "packed8"),
                                                        kernels.packed_layout(*wide))}
    rows = torch.arange(q.shape[0])
    qs, ql = torch.tensor([0, 5, 22]), torch.tensor([5, 17, 30])
    qp = torch.randn(52, 9, 64, generator=torch.Generator().manual_seed(2))
    op = kernels.paged_prefill_attention()
    for name, (narrow_kv, wide_kv) in layouts.items():
        packed = name == "packed"
        got, want = (torch.ops.kvpool.paged_decode_grouped(q, *kv, rows, tables, lens, starts, shared, 0.125,
                                                           torch.empty_like(q), packed) for kv in (narrow_kv, wide_kv))
        assert not got.isnan().any() and torch.equal(got, want), name
        for window in (0, 24):
            got, want = (op(qp, *kv, qs, ql, lens[:3].clone(), tables[:3].contiguous(), window, 0.125,
                            torch.empty_like(qp), packed) for kv in (narrow_kv, wide_kv))
            assert not got.isnan().any() and torch.equal(got, want), (name, window)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_nan_in_a_seen_value_reads_as_nan(kv_dtype) -> None:
    """e4m3fn has no infinities and one NaN per sign (every exponent and mantissa bit set): the kernel must
    read it as NaN, not as 480 (what the bits shifted into fp16's places mean), as torch's widening does.
    Rows that see the value become NaN there; the other sequence's rows stay finite and exact."""
    if not kernels.prefill_supported(64, 16, torch.float32):
        pytest.skip("this CPU lacks what the fp32 prefill kernel needs")
    _, kc, vc, tables, lens, _, _ = grouped_scenario([(0, [40]), (0, [33])], dtype=kv_dtype)
    for sign in (0x00, 0x80):
        vc.view(torch.uint8)[1, tables[0, 1], 3, 5] = 0x7F | sign  # sequence 0's value 19, kv head 1
        assert vc[1, tables[0, 1], 3, 5].float().isnan()
        qp = torch.randn(30, 9, 64, generator=torch.Generator().manual_seed(5))
        qs, ql = torch.tensor([0, 20]), torch.tensor([20, 10])
        got, want = (kernels.paged_prefill_attention()(qp, *kv, qs, ql, lens, tables, 0, 0.125, torch.empty_like(qp),
                                                       False) for kv in ((kc, vc), (kc.float(), vc.float())))
        # Sequence 0's queries are its positions 20..39, all after key 19: element 5 of kv head 1's query heads
        # (3..5) is NaN for every one of them, and nothing else is.
        nan = torch.zeros_like(got, dtype=torch.bool)
        nan[:20, 3:6, 5] = True
        assert torch.equal(got.isnan(), nan) and torch.equal(want.isnan(), nan)
        assert torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_write_kv_rounds_fp32_into_narrow_caches_as_round_to_does(kv_dtype) -> None:
    """As torch's `.to()` rounds, past the dtype's range saturated (`round_to`): bit for bit, subnormals,
    ties and values past fp8's and fp16's largest included."""
    assert kernels.fused_ops() is not None, "the kernels must build on this machine"
    g = torch.Generator().manual_seed(7)
    kv_heads, nb, bs, dim, t = 3, 5, 16, 64, 40
    # Rows of every scale: fp16's and fp8's subnormals (1e-4 .. 1e-7) up to past fp16's range (1e5).
    scale = 10.0 ** torch.arange(-7, 6).repeat(4)[:t]
    k = torch.randn(t, kv_heads, dim, generator=g) * scale[:, None, None]
    v = (torch.randn(t, 2 * kv_heads, dim, generator=g) * scale[:, None, None])[:, ::2]  # strided heads
    k[0, 0, :4] = torch.tensor([448.0, 464.0, 57344.0, 61440.0])  # e4m3's largest, a tie past it; e5m2's
    # Ties to even in e4m3's normals and subnormals (and e5m2's normals), zeros of both signs.
    k[0, 1, :8] = torch.tensor([1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 1.125, 1.375, 0.0, -0.0])
    slots = torch.randperm(nb * bs, generator=g)[:t]
    kc = torch.zeros(kv_heads, nb, bs, dim, dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    torch.ops.kvpool.write_kv(k, v, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    for ref, x in ((kr, k), (vr, v)):
        rounded = indexable(round_to(x, kv_dtype)).transpose(0, 1)
        indexable(ref).view(kv_heads, nb * bs, dim).index_copy_(1, slots, rounded)
    assert torch.isfinite(kr.float()).all() and torch.isfinite(vr.float()).all()  # (saturated, never inf)
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))  # (bytes: -0.0 is not 0.0)
    assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))
    pk, pv = (torch.zeros_like(kc), torch.zeros_like(vc))
    torch.ops.kvpool.write_kv_packed(k, v, pk, pv, slots)
    want_k, want_v = kernels.packed_layout(kr, vr, "packed8")
    assert torch.equal(pk.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(pv.view(torch.uint8), want_v.view(torch.uint8))
    # NaN stays NaN (not clamped to a number; its bits may differ from torch's: bf16's vector cast sets them all).
    nan = torch.full((1, kv_heads, dim), float("nan"))
    torch.ops.kvpool.write_kv(nan, nan, kc, vc, slots[:1])
    torch.ops.kvpool.write_kv_packed(nan, nan, pk, pv, slots[:1])
    assert all(int(c.float().isnan().sum()) == kv_heads * dim for c in (kc, vc, pk, pv))
    with pytest.raises(RuntimeError, match=r"must share one dtype \(or be float32 into bfloat16, float16 or "
                                           r"fp8 caches\)"):
        torch.ops.kvpool.write_kv(k.to(torch.bfloat16), v.to(torch.bfloat16), kc.float(), vc.float(), slots)
