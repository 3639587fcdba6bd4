"""Batch invariance: making a token's result independent of how many other rows a step computes.

MKL's fp32 matmul picks a different kernel for a handful of rows (on this machine: fewer than 12)
than for many, and the two sum in a different order, so the same token computed alone (a decode, a
short suffix after a prefix hit) and within a long prompt differ in the last bits. Padding every
matmul to at least MIN_ROWS rows keeps it on the many-rows kernel. The bf16 kernels (oneDNN, plain
or prepacked) reduce a row the same way whatever the row count, so bf16 needs no padding: half the
weight bytes per step, which is what a short suffix after a prefix hit pays for. Together with
`attention.invariant_attention`, this makes an omni stage's per-token outputs bit-identical whether
its prefix was a cache hit or computed, chunked or not, batched with anything. The threshold is an
empirical property of the BLAS, which the omni tests check end to end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 16


def pad_rows(x: torch.Tensor, min_rows: int = MIN_ROWS) -> torch.Tensor:
    """x with zero rows appended up to `min_rows` (the caller slices the result back)."""
    n = x.shape[0]
    return x if n >= min_rows else F.pad(x, (0, 0) * (x.dim() - 1) + (0, min_rows - n))


class RowPaddedLinear(nn.Module):
    """A linear layer computed on at least MIN_ROWS rows, whatever the input's row count."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight = lin.weight
        self.bias = lin.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(pad_rows(x), self.weight, self.bias)[: x.shape[0]]


def make_batch_invariant(model: nn.Module, dtype: torch.dtype) -> None:
    """Wrap every fp32 projection of a kvpool Llama (the weights stay shared, nothing is copied); bf16
    projections are row-count invariant as they are (`tests/runner/test_batch_invariance.py` checks it)."""
    if dtype == torch.bfloat16:
        return
    for layer in model.layers:  # type: ignore[attr-defined]
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, name)
            if not isinstance(lin, nn.Linear):
                raise ValueError("batch_invariant: needs plain float32 linear layers (not packed bf16)")
            setattr(layer, name, RowPaddedLinear(lin))
