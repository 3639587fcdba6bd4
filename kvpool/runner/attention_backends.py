"""Attention backends: each path of paged attention as one object, chosen once when the runner starts.

A backend `plan`s a step's `AttentionMetadata` for one KV cache group (what its kernels need: cascade
groups, the decode batch, masks, kernel arguments) and its `forward` runs the attention of every layer
reading that group. The planned metadata names its backend, so `paged_attention` (the op every model
calls) dispatches without testing mode flags per call.

- `TorchBackend`: torch ops only; cascade attention over shared prefixes (see kvpool.runner.attention).
- `CpuKernelBackend`: kvpool's compiled CPU kernels (kvpool.runner.kernels) for decode rows (grouped by
  shared prefix, which they then read once per group) and, where the CPU suits the prefill kernel (bf16:
  AVX-512 BF16; fp32: AVX2), for multi-token chunks; torch for the rest.
- `BatchInvariantBackend`: results independent of batching, chunking and prefix hits (omni stages).

A CUDA backend would be one more class here.
"""

from __future__ import annotations

import torch

from kvpool.runner import kernels
from kvpool.runner.attention import (
    MIN_CASCADE_TOKENS,
    AttentionMetadata,
    invariant_attention,
    merge_cascades,
    plan_cascades,
    plan_decode_batch,
    plan_masks,
    plan_prefill_batch,
    plan_windows,
    torch_chunk_rows,
    torch_decode_rows,
    write_kv,
)


class AttentionBackend:
    """Plans a group's metadata for a step, and computes attention from it (see the module doc)."""

    name = "base"

    def __init__(self, block_size: int, dtype: torch.dtype, group_heads: int) -> None:
        self.block_size = block_size
        self.dtype = dtype
        self.group_heads = group_heads  # query heads per kv head (masks repeat their rows that often)

    def plan(self, meta: AttentionMetadata, twin: AttentionMetadata | None = None) -> None:
        """Annotate `meta` for `forward`. `twin`: planned metadata of another group with the same
        window and sequences, whose masks this one may share (they depend on positions only)."""
        meta.backend = self

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def _masks(self, meta: AttentionMetadata, twin: AttentionMetadata | None) -> None:
        if twin is None:
            plan_masks(meta, self.dtype, self.group_heads, self.block_size)
        else:
            for mine, theirs in zip(meta.seqs, twin.seqs, strict=True):
                mine.bias = theirs.bias


class TorchBackend(AttentionBackend):
    """Torch ops: batched decode rows, per-sequence chunks, cascades over shared prefixes."""

    name = "torch"

    def __init__(self, block_size: int, dtype: torch.dtype, group_heads: int, *, cascade: bool = True,
                 min_cascade_tokens: int = MIN_CASCADE_TOKENS) -> None:
        super().__init__(block_size, dtype, group_heads)
        self.cascade = cascade
        self.min_cascade_tokens = min_cascade_tokens

    def plan(self, meta: AttentionMetadata, twin: AttentionMetadata | None = None) -> None:
        meta.backend = self
        plan_windows(meta, self.block_size)
        if self.cascade:
            plan_cascades(meta, self.block_size, self.min_cascade_tokens)
        plan_decode_batch(meta, self.block_size)
        self._masks(meta, twin)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        acc, lse = _partials(q, meta)
        if meta.decode_seqs:
            torch_decode_rows(q, k_cache, v_cache, meta, scale, out, acc, lse)
        torch_chunk_rows(q, k, v, k_cache, v_cache, meta, scale, out, acc, lse)
        if acc is not None and lse is not None:
            merge_cascades(q, k_cache, v_cache, meta, scale, out, acc, lse)
        return out


class CpuKernelBackend(AttentionBackend):
    """kvpool's compiled CPU kernels: every decode row; with `prefill` every multi-token chunk too. Decode
    rows are grouped by shared prefix with `prefill` or in fp32. Chunks the kernels do not take go through
    torch, with cascades."""

    name = "cpu-kernels"

    def __init__(self, block_size: int, dtype: torch.dtype, group_heads: int, *, prefill: bool,
                 cascade: bool = True, min_cascade_tokens: int = MIN_CASCADE_TOKENS, packed: bool = False) -> None:
        super().__init__(block_size, dtype, group_heads)
        if packed and not prefill:
            raise ValueError("packed: the packed KV layout is read by the prefill/grouped kernels only")
        # The caches hold keys (bf16: and values) as the kernels read them (kvpool.runner.kernels.packed_layout):
        # packed once as they are written, never again at each read.
        self.packed = packed
        self.decode_op = kernels.paged_decode_attention()
        if self.decode_op is None:
            raise RuntimeError("CpuKernelBackend: kvpool's decode kernel did not build on this machine")
        self.prefill_op = kernels.paged_prefill_attention() if prefill else None
        if prefill and self.prefill_op is None:
            raise RuntimeError("CpuKernelBackend: kvpool's prefill kernel did not build on this machine")
        self.prefill = prefill
        # Decode rows sharing a cached prefix read its keys once for the group: the bf16 kernels' grouped
        # form, or in fp32 the decode kernel's (any CPU; the same arithmetic per row as ungrouped).
        self.grouped = prefill or dtype == torch.float32
        self.cascade = cascade
        self.min_cascade_tokens = min_cascade_tokens

    def plan(self, meta: AttentionMetadata, twin: AttentionMetadata | None = None) -> None:
        meta.backend = self
        plan_windows(meta, self.block_size)
        if self.cascade and not self.prefill:  # (with the prefill kernel, no row is left for a cascade)
            plan_cascades(meta, self.block_size, self.min_cascade_tokens, skip_decodes=True)
        if self.prefill and meta.window is not None:
            # Sliding-window layers: decode rows through the prefill kernel too, as one-query chunks, so a
            # token's arithmetic is the same whether it was decoded or is recomputed in a prompt (after a
            # preemption), and bf16 tokens do not depend on the batch, the allocator or the chunk size.
            plan_prefill_batch(meta, decode_rows=True)
            return
        plan_decode_batch(meta, self.block_size, kernel=True, grouped=self.grouped)
        if self.prefill:
            plan_prefill_batch(meta)
        else:
            self._masks(meta, twin)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.packed:
            torch.ops.kvpool.write_kv_packed(k, v, k_cache, v_cache, meta.slot_mapping)
        elif k_cache.is_contiguous():
            torch.ops.kvpool.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.decode_seqs:
            rows, tables, lows, lens = meta.decode_rows, meta.decode_tables, meta.decode_lows, meta.decode_lens
            assert rows is not None and tables is not None and lows is not None and lens is not None
            if meta.decode_group_starts is not None:
                # Reads its rows of q and writes the same rows of out: no gather, no scatter.
                torch.ops.kvpool.paged_decode_grouped(q.contiguous(), k_cache, v_cache, rows, tables, lens,
                                                      meta.decode_group_starts, meta.decode_shared, scale, out,
                                                      self.packed)
            else:
                assert not self.packed, "the packed layout needs every decode row grouped (full attention)"
                qd = q[rows]
                out[rows] = self.decode_op(qd, k_cache, v_cache, tables, lows, lens, scale, torch.empty_like(qd))
        if self.prefill:
            if meta.prefill_args:
                self.prefill_op(q.contiguous(), k_cache, v_cache, *meta.prefill_args, meta.window or 0, scale, out,
                                self.packed)
            return out
        acc, lse = _partials(q, meta)
        torch_chunk_rows(q, k, v, k_cache, v_cache, meta, scale, out, acc, lse)
        if acc is not None and lse is not None:
            merge_cascades(q, k_cache, v_cache, meta, scale, out, acc, lse)
        return out


class BatchInvariantBackend(AttentionBackend):
    """Every sequence through `invariant_attention`: no cascades, no decode batch, no kernels."""

    name = "batch-invariant"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return invariant_attention(q, k_cache, v_cache, meta, scale)


def _partials(q: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp32 outputs and log-sum-exps of cascade members' suffixes, to merge with their prefix (None: no
    cascade this step)."""
    if not meta.groups:
        return None, None
    return (torch.empty(q.shape, dtype=torch.float32, device=q.device),
            torch.empty(q.shape[:2], dtype=torch.float32, device=q.device))


def select_backend(*, block_size: int, dtype: torch.dtype, group_heads: int, batch_invariant: bool,
                   decode_kernel: bool, prefill_kernel: bool, cascade: bool, packed: bool = False) -> AttentionBackend:
    """The runner's backend, chosen once from what this model, dtype and machine allow."""
    if batch_invariant:
        return BatchInvariantBackend(block_size, dtype, group_heads)
    if decode_kernel:
        return CpuKernelBackend(block_size, dtype, group_heads, prefill=prefill_kernel, cascade=cascade,
                                packed=packed)
    return TorchBackend(block_size, dtype, group_heads, cascade=cascade)
