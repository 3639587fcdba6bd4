"""kvpool's bf16 linear kernel (kernels/linear_bf16.cpp) against an exact emulation of the instruction it is
built on: every output bit, for the shapes whose edges the kernel handles separately (an odd K, N not a
multiple of 16 or of 48, row counts that leave partial tiles and span several row blocks, a bias)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpool.runner import kernels
from kvpool.runner.models.llama import PackedLinear

pytestmark = pytest.mark.skipif(not kernels.linear_bf16_supported(),
                                reason="the kernels are not built with AVX-512 BF16 here")


def emulate(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """`vdpbf16ps` over k in order, one fp32 accumulator per output: for each pair of k, the odd element's
    product is added, then the even one's (a product of two bf16 values is exact in fp32; each add rounds
    to nearest even); the sum starts from the bias and is rounded to bf16 once at the end."""
    m, k = x.shape
    acc = torch.zeros(m, w.shape[0]) if b is None else b.float().expand(m, -1).clone()
    xf, wf = x.float(), w.float()
    for p in range((k + 1) // 2):
        for j in (2 * p + 1, 2 * p):
            if j < k:
                acc = acc + xf[:, j:j + 1] * wf[:, j][None, :]
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize(("m", "k", "n", "bias"), [
    (1, 2, 1, False),       # the smallest shape
    (5, 64, 40, False),     # a partial tile of rows; 40 columns: one panel of 3 groups, the last partial
    (9, 63, 17, True),      # odd K (the last pair padded), N = 16 + 1, a bias
    (16, 128, 96, True),    # whole tiles and panels
    (131, 576, 50, False),  # SmolLM2's hidden size: 131 rows span two row blocks (112 rows each)
])
def test_bits_equal_the_instruction_emulated(m: int, k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    y = torch.ops.kvpool.linear_bf16(x, torch.ops.kvpool.pack_linear_bf16(w), b, n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert torch.equal(y, emulate(x, w, b))


def test_packed_linear_runs_it_on_any_leading_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(33, 20, generator=g).to(torch.bfloat16)
    assert not PackedLinear(w, None).own  # oneDNN's where it is row-count invariant (this small shape: always)
    monkeypatch.setenv("KVPOOL_BF16_LINEAR", "kvpool")
    assert not PackedLinear(w, None, native=False).own  # the engine's native_kernels=False: torch's kernels only
    lin = PackedLinear(w, None)
    assert lin.own
    x = torch.randn(2, 7, 40, generator=g).to(torch.bfloat16)[..., ::2]  # (2, 7, 20), not contiguous
    y = lin(x)
    assert y.shape == (2, 7, 33)
    assert torch.equal(y.reshape(14, 33), emulate(x.reshape(14, 20), w, None))


def test_a_shape_onednn_sums_by_row_count_runs_on_kvpools_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN's bf16 kernel gives a row other bits at some row counts (AMX tiles on an Intel Xeon, for
    the vocabulary's shape), the probe says so and kvpool's kernel runs that shape; a forced choice is kept."""
    from kvpool.runner import invariant

    seen: list[tuple] = []

    def not_invariant(linear, in_features, dtype, key, persist=False):  # type: ignore[no-untyped-def]
        seen.append(key)
        return False

    monkeypatch.setattr("kvpool.runner.models.llama.rows_invariant", not_invariant)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 24, generator=g).to(torch.bfloat16)
    lin = PackedLinear(w, None)
    assert lin.own and seen == [("onednn", 48, 24, False)]
    x = torch.randn(5, 24, generator=g).to(torch.bfloat16)
    assert torch.equal(lin(x), emulate(x, w, None))
    for forced, own in (("onednn", False), ("kvpool", True)):
        monkeypatch.setenv("KVPOOL_BF16_LINEAR", forced)
        assert PackedLinear(w, None).own is own
    assert len(seen) == 1  # (a forced choice is not probed)
    assert invariant.rows_invariant(lambda t: t @ w.T, 24, torch.bfloat16, key="test-matmul")


def test_the_probe_finds_a_row_count_switch() -> None:
    """A 'kernel' that sums in another order above 16 rows (fp64 then rounded, against fp32) is caught; one
    whose rows depend on their position in the call too; and a plain row-wise one passes."""
    from kvpool.runner.invariant import rows_invariant

    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))

    def switches(x: torch.Tensor) -> torch.Tensor:
        return (x.double() @ w.double().T).float() if x.shape[0] > 16 else x @ w.T

    def by_position(x: torch.Tensor) -> torch.Tensor:
        y = x @ w.T
        return torch.cat([y[:-1], y[-1:].double().mul(1 + 1e-7).float()])

    assert not rows_invariant(switches, 96, torch.float32, key="test-switches")
    assert not rows_invariant(by_position, 96, torch.float32, key="test-position")
    assert rows_invariant(lambda x: torch.stack([r @ w.T for r in x]), 96, torch.float32, key="test-rowwise")


def test_an_unknown_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_BF16_LINEAR", "mkl")
    with pytest.raises(ValueError, match="KVPOOL_BF16_LINEAR: 'mkl' is none of 'auto', 'kvpool', 'onednn'"):
        PackedLinear(torch.ones(4, 4, dtype=torch.bfloat16), None)


def test_a_mismatched_input_is_refused() -> None:
    packed = torch.ops.kvpool.pack_linear_bf16(torch.ones(8, 10, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 12 features, the packed weight 5 pairs"):
        torch.ops.kvpool.linear_bf16(torch.ones(3, 12, dtype=torch.bfloat16), packed, None, 8)
    with pytest.raises(RuntimeError, match="n = 17 does not match"):
        torch.ops.kvpool.linear_bf16(torch.ones(3, 10, dtype=torch.bfloat16), packed, None, 17)
    with pytest.raises(RuntimeError, match="x has 0 features"):  # a division by zero before
        torch.ops.kvpool.linear_bf16(torch.ones(3, 0, dtype=torch.bfloat16), packed, None, 8)
    with pytest.raises(RuntimeError, match="bias must have 8 elements"):
        torch.ops.kvpool.linear_bf16(torch.ones(3, 10, dtype=torch.bfloat16), packed,
                                     torch.ones(9, dtype=torch.bfloat16), 8)


def test_the_probe_is_per_thread_count_and_kept_on_disk_for_the_engines_kernels(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvpool.runner import invariant

    monkeypatch.setenv("KVPOOL_CACHE", str(tmp_path))
    monkeypatch.setattr(invariant, "_probed", {})
    monkeypatch.setattr(invariant, "_on_disk", None)
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    calls = []

    def by_threads(x: torch.Tensor) -> torch.Tensor:  # sums in another order above 3 rows, with 2 threads only
        calls.append(x.shape[0])
        y = torch.stack([r @ w.T for r in x])  # (row by row: the same bits at any row count)
        return y.double().mul(1 + 1e-6).float() if torch.get_num_threads() == 2 and x.shape[0] > 3 else y

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert invariant.rows_invariant(by_threads, 16, torch.float32, key="k", persist=True)
        torch.set_num_threads(2)
        assert not invariant.rows_invariant(by_threads, 16, torch.float32, key="k", persist=True)
        n = len(calls)
        # Another process on this machine (a fresh memory): answered from disk, the function never called.
        monkeypatch.setattr(invariant, "_probed", {})
        monkeypatch.setattr(invariant, "_on_disk", None)
        assert not invariant.rows_invariant(by_threads, 16, torch.float32, key="k", persist=True)
        torch.set_num_threads(1)
        assert invariant.rows_invariant(by_threads, 16, torch.float32, key="k", persist=True)
        assert len(calls) == n
        (f,) = tmp_path.glob("kernels/*/row_invariance.json")
        assert sorted(json.loads(f.read_text()).values()) == [False, True]
        # Not persisted: probed in every process.
        monkeypatch.setattr(invariant, "_probed", {})
        assert invariant.rows_invariant(by_threads, 16, torch.float32, key="k2")
        assert len(calls) > n and len(json.loads(f.read_text())) == 2
    finally:
        torch.set_num_threads(threads)


def test_batch_invariant_fp32_pads_on_the_first_kernel_found_invariant(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """oneDNN's packed kernel where it is invariant padded, else MKL's; neither: said so (the Xeon with AMX
    beside the H100 made MKL padded to 16 rows give rows 64-128 other bits)."""
    import logging

    from kvpool.runner import invariant
    from kvpool.runner.models.llama import can_pack

    if not can_pack(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN fp32 packing in this torch build")
    lin = torch.nn.Linear(24, 8, bias=True)
    assert isinstance(invariant.RowPaddedLinear(lin).inner, PackedLinear)  # (oneDNN's is invariant here)
    answers = {"onednn": False, "mkl": True}
    monkeypatch.setattr(invariant, "rows_invariant", lambda f, n, d, key, persist=False: answers[key[1]])
    padded = invariant.RowPaddedLinear(lin)
    assert padded.inner == padded._plain
    x = torch.randn(5, 24)
    assert torch.equal(padded(x), torch.nn.functional.linear(invariant.pad_rows(x), lin.weight, lin.bias)[:5])
    answers["mkl"] = False
    with caplog.at_level(logging.WARNING, logger="kvpool.runner.invariant"):
        invariant.RowPaddedLinear(lin)
    assert "no linear kernel on this CPU gives a row of a (8, 24) projection the same bits" in caplog.text


def test_batch_invariant_bf16_says_so_where_onednn_is_not_invariant_and_kvpools_kernel_is_off(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from kvpool.engine.llm import LLM
    from kvpool.runner import invariant

    monkeypatch.setattr(invariant, "rows_invariant", lambda *a, **k: False)
    with caplog.at_level(logging.WARNING, logger="kvpool.runner.invariant"):
        LLM(str(tiny_llama_dir), dtype="bfloat16", skip_tokenizer_init=True, num_blocks=16, block_size=4,
            batch_invariant=True, native_kernels=False, device="cpu")
    assert "batch_invariant: oneDNN's bf16 linear of shape (128, 64) is not row-count invariant" in caplog.text
