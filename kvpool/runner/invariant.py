"""Batch invariance: making a token's result independent of how many other rows a step computes.

A CPU BLAS picks its kernel by the row count, and two kernels may sum a row in different orders, so the
same token computed alone (a decode, a short suffix after a prefix hit) and within a long prompt can
differ in the last bits: MKL's fp32 matmul (fewer than ~12 rows against more on an AMD EPYC; on an Intel
Xeon with AMX, again at 64-128 rows), oneDNN's packed bf16 with AMX tiles for some row counts of a wide
projection (the vocabulary's). Which kernels are invariant is an empirical property of the BLAS and the
CPU, so kvpool checks it here at load (`rows_invariant`, once per shape and thread count on a machine:
the answers are kept beside the compiled kernels) instead of trusting a list: bf16 projections run
oneDNN's packed kernel where it is invariant and kvpool's own (which sums every row the same way by
construction) where it is not (`models.llama.PackedLinear`); batch-invariant fp32 pads every call to at
least MIN_ROWS rows on the first of oneDNN's packed kernel or MKL's that is invariant so padded. Together
with `attention.invariant_attention`, this makes an omni stage's per-token outputs bit-identical whether
its prefix was a cache hit or computed, chunked or not, batched with anything; and bf16 tokens independent
of caching and chunking.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Hashable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MIN_ROWS = 16
# The row counts a linear layer is tried at: around the kernel switches seen (12, 16, 24, 64, 128 rows), odd
# and even; up to 256 (the largest step of decodes most servers run). A row's bits are compared with the
# same row's within the 256-row call, so a dependence on the row's position is caught too.
PROBE_ROWS = (1, 2, 3, 5, 8, 11, 12, 16, 17, 24, 33, 64, 100, 128, 256)
_probed: dict[str, bool] = {}
_on_disk: dict[str, bool] | None = None  # what earlier processes found on this machine (see _disk_file)


def rows_invariant(linear: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
                   key: Hashable, persist: bool = False) -> bool:
    """Whether `linear` gives each row the same bits whatever the number of rows in the call, on this CPU
    at this thread count (remembered under `key` + the thread count: a kernel's choice depends on its
    shape, not on its weights). `persist`: the answer is also kept on disk beside the compiled kernels, whose
    folder is named by the CPU, its flags and the torch build, so later processes on this machine skip the
    probe (for the engine's kernels; a test's own function must not be answered from disk). The probe of
    SmolLM2's vocabulary projection took 0.2-0.6 s on 2 cores, all the model's shapes about 1 s."""
    name = repr((key, torch.get_num_threads()))
    if name not in _probed and persist and name in _disk():
        _probed[name] = _disk()[name]
    if name not in _probed:
        x = torch.randn(PROBE_ROWS[-1], in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        bits = torch.int16 if dtype.itemsize == 2 else torch.int32
        with torch.no_grad():
            full = linear(x).view(bits)
            _probed[name] = all(torch.equal(linear(x[:n]).view(bits), full[:n]) for n in PROBE_ROWS[:-1])
        if persist:
            _remember(name, _probed[name])
    return _probed[name]


def _disk_file() -> Path | None:
    try:
        from kvpool.runner.kernels import build_dir

        return build_dir() / "row_invariance.json"
    except Exception:  # (no cache folder can be named here: probe every time)
        return None


def _disk() -> dict[str, bool]:
    global _on_disk
    if _on_disk is None:
        f, _on_disk = _disk_file(), {}
        try:
            data = json.loads(f.read_text()) if f is not None and f.is_file() else {}
            _on_disk = {k: v for k, v in data.items() if isinstance(v, bool)} if isinstance(data, dict) else {}
        except (OSError, ValueError):
            pass
    return _on_disk


def _remember(name: str, value: bool) -> None:
    f = _disk_file()
    if f is None:
        return
    known = _disk()
    known[name] = value
    try:  # a whole file or none: written aside, then renamed over (two processes may race; either is right)
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=0, sort_keys=True))
        os.replace(tmp, f)
    except OSError as e:
        log.debug("row-count invariance: not kept on disk (%s)", e)


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
                              key=("padded", name, shape), persist=True):
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
        from kvpool.runner.models.llama import PackedLinear

        for m in model.modules():  # (probed at load where kvpool's kernel could take over; not where it cannot)
            if isinstance(m, PackedLinear) and not m.own and not rows_invariant(
                    m, m.in_features, dtype, key=("onednn", m.out_features, m.in_features, m.bias is not None),
                    persist=True):
                log.warning("batch_invariant: oneDNN's bf16 linear of shape %s is not row-count invariant on this "
                            "CPU, and kvpool's own kernel cannot run it here (native_kernels off, or no AVX-512 "
                            "BF16): outputs may differ in their last bits", (m.out_features, m.in_features))
        return
    for layer in model.layers:  # type: ignore[attr-defined]
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, name)
            if not isinstance(lin, nn.Linear):
                raise ValueError("batch_invariant: needs plain float32 linear layers (not packed bf16)")
            setattr(layer, name, RowPaddedLinear(lin))
