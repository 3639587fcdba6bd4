"""Batch invariance: making a token's result independent of how many other rows a step computes.

A CPU BLAS picks its kernel by the row count, and two kernels may sum a row in different orders, so the
same token computed alone (a decode, a short suffix after a prefix hit) and within a long prompt can
differ in the last bits: MKL's fp32 matmul (fewer than ~12 rows against more on an AMD EPYC; on an Intel
Xeon with AMX, again at 64-128 rows), oneDNN's packed bf16 with AMX tiles for some row counts of a wide
projection (the vocabulary's). Which kernels are invariant is an empirical property of the BLAS and the
CPU, so kvpool checks it here at load (`rows_invariant`, once per shape and process) instead of trusting
a list: bf16 projections run oneDNN's packed kernel where it is invariant and kvpool's own (which sums
every row the same way by construction) where it is not (`models.llama.PackedLinear`); batch-invariant
fp32 pads every call to at least MIN_ROWS rows on the first of oneDNN's packed kernel or MKL's that is
invariant so padded. Together with `attention.invariant_attention`, this makes an omni stage's per-token
outputs bit-identical whether its prefix was a cache hit or computed, chunked or not, batched with
anything; and bf16 tokens independent of caching and chunking.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MIN_ROWS = 16
# The row counts a linear layer is tried at: around the kernel switches seen (12, 16, 24, 64, 128 rows), odd
# and even; up to 256 (the largest step of decodes most servers run). A row's bits are compared with the
# same row's within the 256-row call, so a dependence on the row's position is caught too.
PROBE_ROWS = (1, 2, 3, 5, 8, 11, 12, 16, 17, 24, 33, 64, 100, 128, 256)
_probed: dict[Hashable, bool] = {}


def rows_invariant(linear: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
                   key: Hashable) -> bool:
    """Whether `linear` gives each row the same bits whatever the number of rows in the call, on this CPU
    at this thread count (remembered under `key` + the thread count: a kernel's choice depends on its
    shape, not on its weights). About 0.15 s for SmolLM2's vocabulary projection on 2 cores."""
    key = (key, torch.get_num_threads())
    if key not in _probed:
        x = torch.randn(PROBE_ROWS[-1], in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        bits = torch.int16 if dtype.itemsize == 2 else torch.int32
        with torch.no_grad():
            full = linear(x).view(bits)
            _probed[key] = all(torch.equal(linear(x[:n]).view(bits), full[:n]) for n in PROBE_ROWS[:-1])
    return _probed[key]


def pad_rows(x: torch.Tensor, min_rows: int = MIN_ROWS) -> torch.Tensor:
    """x with zero rows appended up to `min_rows` (the caller slices the result back)."""
    n = x.shape[0]
    return x if n >= min_rows else F.pad(x, (0, 0) * (x.dim() - 1) + (0, min_rows - n))


class RowPaddedLinear(nn.Module):
    """A linear layer computed on at least MIN_ROWS rows, whatever the input's row count, by the first kernel
    that is row-count invariant so padded on this CPU: oneDNN's packed fp32 (where oneDNN runs), then MKL's."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight = lin.weight
        self.bias = lin.bias
        self.inner: Callable[[torch.Tensor], torch.Tensor] = self._plain
        if lin.weight.device.type != "cpu":
            return
        from kvpool.runner.models.llama import PackedLinear, can_pack

        shape = (lin.out_features, lin.in_features, lin.weight.dtype, lin.bias is not None)
        candidates: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = []
        if can_pack(lin.weight.dtype, lin.weight.device):
            candidates.append(("onednn", PackedLinear(lin.weight, lin.bias, native=False)))
        candidates.append(("mkl", self._plain))
        for name, inner in candidates:
            if rows_invariant(lambda x, f=inner: f(pad_rows(x))[: x.shape[0]], lin.in_features, lin.weight.dtype,
                              key=("padded", name, shape)):
                self.inner = inner
                return
        log.warning("batch_invariant: no linear kernel on this CPU gives a row of a %s projection the same bits "
                    "at every row count, padded to %d rows; outputs may differ in their last bits", shape[:2],
                    MIN_ROWS)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(pad_rows(x))[: x.shape[0]]


def make_batch_invariant(model: nn.Module, dtype: torch.dtype) -> None:
    """Wrap every fp32 projection of a kvpool Llama (the weights stay shared; oneDNN's packed copy is the
    one extra); bf16 projections are made row-count invariant where they are packed (PackedLinear)."""
    if dtype == torch.bfloat16:
        return
    for layer in model.layers:  # type: ignore[attr-defined]
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, name)
            if not isinstance(lin, nn.Linear):
                raise ValueError("batch_invariant: needs plain float32 linear layers (not packed bf16)")
            setattr(layer, name, RowPaddedLinear(lin))
