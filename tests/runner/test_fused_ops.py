"""The fused ops (RMSNorm, SiLU-and-multiply, rotary in bf16 and fp32; greedy argmax over bf16) against the torch
code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpool.runner import kernels
from kvpool.runner.models.llama import RMSNorm, Rotary


@pytest.fixture(scope="module")
def ops():
    fused = kernels.fused_ops()
    assert fused is not None, "the kernels must build on this machine"
    return fused


DTYPES = [torch.bfloat16, torch.float32]


def assert_rounding_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: equal but for rare last-bit differences (an exp, a sum order), each at most one bf16 step.
    fp32: within a few units in the last place (another sum order, a polynomial exp), below 1e-30 alike."""
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = got.double() - want.double()
    if want.dtype == torch.bfloat16:
        step = want.double().abs().clamp(min=1e-30) * 2 ** -7
        assert (diff.abs() <= step).all()
        assert (diff != 0).double().mean() < 0.02
    else:
        assert (diff.abs() <= want.double().abs() * 2 ** -20 + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(ops, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    x = (3 * torch.randn(37, 576, generator=g)).to(dtype)
    want = norm(x)
    got = ops.rms_norm(x, norm.weight, 1e-5, torch.empty_like(x))
    assert_rounding_close(got, want)
    x3 = x.view(37, 9, 64)  # per-head norms (LFM2's q/k layernorm) see (T, heads, head_dim)
    norm64 = RMSNorm(64, 1e-5).to(dtype)
    assert_rounding_close(ops.rms_norm(x3, norm64.weight, 1e-5, torch.empty_like(x3)), norm64(x3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(ops, dtype) -> None:
    g = torch.Generator().manual_seed(1)
    gate_up = (4 * torch.randn(23, 2 * 1536, generator=g)).to(dtype)
    gate_up[0, :8] = torch.tensor([-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, -0.5])  # tails and zero
    gate, up = gate_up.chunk(2, dim=-1)
    got = ops.silu_and_mul(gate_up, gate_up.new_empty(23, 1536))
    assert_rounding_close(got, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_of_gates_below_exps_range_is_zero_as_torchs(ops, dtype) -> None:
    # exp(x) stops at -87 (fp32's normal range): silu(-1e38) came out -1.65, silu(-inf) -inf.
    gate = torch.tensor([-1e38, -1e36, -1e4, -90.0, -88.0, -87.0, -86.0, 3e38, -float("inf")]).to(dtype)
    gate_up = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)
    got = ops.silu_and_mul(gate_up, gate_up.new_empty(1, len(gate)))[0]
    want = F.silu(gate)
    assert torch.isnan(got[-1]) and torch.isnan(want[-1])
    # (at -88 torch gives a denormal, -5e-37, where the kernel's exp stops: 0 here, 5e-37 off)
    assert torch.allclose(got[:-1].double(), want[:-1].double(), rtol=2 ** -7, atol=1e-36)
    assert (got[:4] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bit_exact(ops, dtype) -> None:
    g = torch.Generator().manual_seed(2)
    rot = Rotary(64, 10000.0, 4096)
    qkv = torch.randn(50, 9 * 64 + 2 * 3 * 64, generator=g).to(dtype)
    q = qkv[:, :576].view(50, 9, 64)  # a strided view, as the fused qkv projection yields it
    positions = torch.randint(0, 4096, (50,), generator=g)
    got = ops.rotary(q, positions, rot.cos, rot.sin, torch.empty(q.shape, dtype=q.dtype))
    assert torch.equal(got, rot(q, positions))


def test_refuses_bad_input(ops) -> None:
    rot = Rotary(64, 10000.0, 128)
    x = torch.randn(4, 2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="position 128 is outside the rotary table's 128 positions"):
        ops.rotary(x, torch.tensor([0, 1, 2, 128]), rot.cos, rot.sin, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="weight must be a contiguous Float tensor like the input"):
        ops.rms_norm(x.float(), torch.ones(64, dtype=torch.bfloat16), 1e-5, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16 or float32 tensor"):
        ops.rms_norm(x.half(), torch.ones(64, dtype=torch.half), 1e-5, torch.empty_like(x.half()))
    with pytest.raises(RuntimeError, match="out must be a contiguous BFloat16 tensor like the input"):
        ops.silu_and_mul(x, torch.empty(4, 2, 32))
    with pytest.raises(RuntimeError, match="twice as wide"):
        ops.silu_and_mul(x, torch.empty(4, 2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="twice as wide"):  # as many values, other rows
        ops.silu_and_mul(x.view(8, 64), torch.empty(2, 2, 32, dtype=torch.bfloat16))
    # Empty widths: an integer division by zero killed the process.
    with pytest.raises(RuntimeError, match="weight must not be empty"):
        ops.rms_norm(x[..., :0].contiguous(), torch.ones(0, dtype=torch.bfloat16), 1e-5,
                     torch.empty(4, 2, 0, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"out must be \(..., n\) with n >= 1"):
        ops.silu_and_mul(x[..., :0].contiguous(), torch.empty(4, 2, 0, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_is_torch_argmax_of_the_fp32_logits(ops, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    # Few distinct values, so most rows have ties (the lowest index must win, across lanes and the tail).
    x = torch.randint(-3, 4, (40, 1000), generator=g).to(dtype)
    x[0] = 0  # all tied: index 0
    x[1, 999] = 9  # the max in the tail after the last whole 16 lanes
    x[2, 17] = float("nan")  # torch: a NaN is the maximum
    x[3, 5] = x[3, 700] = float("nan")  # the first NaN
    x[4, :3] = -float("inf")
    x[5, 998] = float("nan")  # a NaN in the tail only
    x[6, 3:] = -float("inf")
    x[6, 1] = float("inf")
    for rows in (x, x[:, :7], x[:, :8], x[:, :999], torch.randn(64, 49152, generator=g).to(dtype)):
        rows = rows.contiguous()
        assert ops.argmax_rows(rows).tolist() == rows.float().argmax(dim=-1).tolist()
    with pytest.raises(RuntimeError, match="logits must be a contiguous bfloat16 or float32"):
        ops.argmax_rows(x.half())
    with pytest.raises(RuntimeError, match="logits must be a contiguous bfloat16 or float32"):
        ops.argmax_rows(x.t())
