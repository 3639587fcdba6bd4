"""Recurrent-state layers (Mamba, short convolutions) over the paged cache, and the one memory pool they
share with attention layers.

Memory: the groups' pages differ in size (an attention block against a layer's state), so the manager
runs the two-level pool (`kvpool.core.two_level_pool`): block id j of a group whose per-layer page is p
bytes is bytes [j * p, (j + 1) * p) of one buffer. Groups have equal layer counts k (the grouping
rule), so the runner keeps k byte buffers ("tensor slots": the i-th layer of every group uses slot i),
each of `num_large_pages * lcm(per-layer pages)` bytes, and views each as one tensor per group type:
attention as (blocks, 2, kv_heads, block_size, head_dim) whose K and V halves are handed to the
attention kernels head-major, states as (blocks, *state_shape).

States: the manager's rule (`MambaManager`) is that block j's page holds the state after the tokens of
blocks 0..j. A step reads the state from the page of the block holding its last computed token (zeros
when nothing is computed) and writes the state after its last token into the page of the block holding
that token. A request admitted in a step may start from a state another request of the same step
writes (a page cached at allocation time): the writer is always scheduled first, so states are
computed in batch order: the single-token (decode) rows first, all at once (a decode's input page is
its own, written in an earlier step), then each multi-token chunk in order, and with them a single
token whose input page an earlier sequence of the step writes (a one-token prompt suffix after a hit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvpool.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MambaSpec


@dataclass
class StateMetadata:
    """Where each sequence of a step reads and writes one state group's pages."""

    # Multi-token chunks (and a first token), in batch order: (q_start, q_end, src page or -1, dst page).
    chunks: list[tuple[int, int, int, int]] = field(default_factory=list)
    # Single-token rows continuing a state: their rows in the step, source and destination pages.
    decode_rows: torch.Tensor | None = None
    decode_src: torch.Tensor | None = None
    decode_dst: torch.Tensor | None = None


def plan_state(spans: Sequence[tuple[int, int, int]], tables: Sequence[Sequence[int]], block_size: int,
               device: torch.device) -> StateMetadata:
    """`spans[i]` = (q_start, start position, number of tokens) of sequence i; `tables[i]` its block table
    in this group."""
    meta = StateMetadata()
    rows, src, dst = [], [], []
    written: set[int] = set()  # pages written by the sequences before this one
    for (q, start, n), table in zip(spans, tables, strict=True):
        end = start + n
        out = table[(end - 1) // block_size]
        inp = table[(start - 1) // block_size] if start > 0 else -1
        if out == 0 or inp == 0:
            raise ValueError(f"state page missing: positions {start}..{end} read page {inp}, write page {out} "
                             f"(the null block)")
        # A single token continuing a state written earlier in this step (a prefix hit on a page cached at
        # allocation) is no decode: it must wait for its writer, so it runs with the chunks, in order.
        if n == 1 and inp >= 0 and inp not in written:
            rows.append(q)
            src.append(inp)
            dst.append(out)
        else:
            meta.chunks.append((q, q + n, inp, out))
        written.add(out)
    if rows:
        meta.decode_rows = torch.tensor(rows, dtype=torch.long, device=device)
        meta.decode_src = torch.tensor(src, dtype=torch.long, device=device)
        meta.decode_dst = torch.tensor(dst, dtype=torch.long, device=device)
    return meta


def run_conv_state(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                   meta: StateMetadata) -> torch.Tensor:
    """A depthwise causal convolution of `u` (T, H) with `weight` (H, L), continuing each sequence from its
    state page: `state` is (pages, H, L - 1), the last L - 1 inputs. Returns (T, H); writes the new states."""
    keep = weight.shape[1] - 1
    y = torch.empty_like(u)
    if meta.decode_rows is not None:
        rows = meta.decode_rows
        win = torch.cat([state.index_select(0, meta.decode_src), u[rows].unsqueeze(-1)], dim=-1)  # (B, H, L)
        out = (win * weight).sum(-1)
        y[rows] = out if bias is None else out + bias
        state.index_copy_(0, meta.decode_dst, win[:, :, 1:])
    for q0, q1, src, dst in meta.chunks:
        prev = state[src] if src >= 0 else u.new_zeros(u.shape[1], keep)
        win = torch.cat([prev, u[q0:q1].T], dim=-1)  # (H, L - 1 + n)
        # Each output's L inputs times the taps, as for the decodes above: F.conv1d's depthwise path
        # costs milliseconds per call on the CPU for these sizes.
        out = (win.unfold(-1, keep + 1, 1) * weight[:, None, :]).sum(-1).T  # (n, H)
        y[q0:q1] = out if bias is None else out + bias
        state[dst] = win[:, -keep:]
    return y


def layer_specs(layer_state_shapes: Sequence[tuple[tuple[int, ...], ...] | None], block_size: int,
                num_kv_heads: int, head_size: int, dtype_bytes: int) -> list[KVCacheSpec]:
    """Per layer: a `MambaSpec` for a state layer (its state in the model's dtype), full attention otherwise."""
    return [FullAttentionSpec(block_size, num_kv_heads, head_size, dtype_bytes) if shapes is None
            else MambaSpec(block_size, state_shapes=tuple(shapes), state_dtype_bytes=(dtype_bytes,) * len(shapes))
            for shapes in layer_state_shapes]


def group_page_sizes(specs: Sequence[KVCacheSpec], layers_per_group: int) -> list[int]:
    """Per group: one page of each of its layers (the manager's `page_sizes`)."""
    return [s.page_size_bytes * layers_per_group for s in specs]


def large_page_bytes(specs: Sequence[KVCacheSpec], layers_per_group: int) -> int:
    """Bytes of one large page of the two-level pool (one page of every group fits it a whole number of times)."""
    return math.lcm(*group_page_sizes(specs, layers_per_group))


class PagedBuffers:
    """The byte buffers of a pool whose groups' pages differ, and each layer's view of them."""

    def __init__(self, specs: Sequence[KVCacheSpec], group_of_layer: Sequence[int], tensor_of_layer: Sequence[int],
                 num_pages: int, dtype: torch.dtype, device: torch.device) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        slots = max(tensor_of_layer) + 1
        self.lcm = math.lcm(*(s.page_size_bytes for s in specs))  # per layer: a large page is this much of a slot
        self.page_sizes = group_page_sizes(specs, slots)
        self.buffers = [torch.zeros(num_pages * self.lcm // elem, dtype=dtype, device=device) for _ in range(slots)]
        self.caches: list[object] = []
        for g, t in zip(group_of_layer, tensor_of_layer, strict=True):
            self.caches.append(self._view(self.buffers[t], specs[g], elem))

    @staticmethod
    def _view(buf: torch.Tensor, spec: KVCacheSpec, elem: int) -> object:
        nb = buf.numel() * elem // spec.page_size_bytes
        if isinstance(spec, MambaSpec):
            pages = buf.view(nb, spec.page_size_bytes // elem)
            if any(b != elem for b in spec.state_dtype_bytes):
                raise ValueError("state_dtype_bytes: states in another dtype than the model's are not supported")
            views, off = [], 0
            for shape in spec.state_shapes:
                n = math.prod(shape)
                views.append(pages[:, off:off + n].view(nb, *shape))
                off += n
            return tuple(views)
        if type(spec) is not FullAttentionSpec:
            raise ValueError(f"kv_cache_spec: {type(spec).__name__} layers cannot share a pool with state layers yet")
        # Blocks outermost, so block j is one contiguous page; the kernels see K and V head-major.
        kv = buf.view(nb, 2, spec.num_kv_heads, spec.block_size, spec.head_size)
        return kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)
