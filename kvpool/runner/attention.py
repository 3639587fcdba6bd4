"""Paged attention: K/V written through a slot mapping, read back through block tables.

`paged_attention` is the one attention op every model calls, so a fused GPU kernel can replace it
without touching a model. The CPU path gathers each sequence's blocks and runs PyTorch's
scaled-dot-product attention: decodes (one query token each) in one padded, masked batch; prefill
chunks one sequence at a time with a causal mask offset by the cached context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    q_start: int  # rows of this sequence's chunk in the step's token batch: [q_start, q_end)
    q_end: int
    context_len: int  # tokens in the cache once this chunk is written, the chunk included
    block_ids: torch.Tensor  # (ceil(context_len / block_size),) long


@dataclass
class AttentionMetadata:
    """Where each token of the step goes in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # (T,) long: block_id * block_size + offset for every token
    num_decodes: int = 0  # the first num_decodes tokens are single-token decodes, one per sequence
    decode_block_tables: torch.Tensor | None = None  # (num_decodes, max_blocks) long, padded with 0
    decode_seq_lens: torch.Tensor | None = None  # (num_decodes,) context length incl. the new token
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode_mask: torch.Tensor | None = None  # built once per step, shared by every layer


def build_decode_mask(meta: AttentionMetadata, block_size: int) -> None:
    if meta.num_decodes and meta.decode_block_tables is not None and meta.decode_seq_lens is not None:
        max_len = meta.decode_block_tables.shape[1] * block_size
        pos = torch.arange(max_len, device=meta.decode_seq_lens.device)
        meta.decode_mask = (pos[None, :] < meta.decode_seq_lens[:, None])[:, None, None, :]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V at their slots (caches: (num_blocks, block_size, kv_heads, head_dim))."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, heads, head_dim); k, v: (T, kv_heads, head_dim). Returns (T, heads, head_dim).

    Every token's K/V is written before any sequence reads, so a sequence may attend to blocks that
    another sequence of the same step computes (a prefix hit on blocks cached at allocation time).
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    nb, bs, hkv, d = k_cache.shape
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        tables = meta.decode_block_tables
        assert tables is not None and meta.decode_mask is not None
        kk = k_cache[tables].view(nd, -1, hkv, d).transpose(1, 2)
        vv = v_cache[tables].view(nd, -1, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kk, vv, attn_mask=meta.decode_mask,
                                           scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for p in meta.prefills:
        ql = p.q_end - p.q_start
        qp = q[p.q_start:p.q_end].transpose(0, 1)
        if ql == p.context_len:
            # No cached context: attend to the chunk's own K/V, as computed.
            kk = k[p.q_start:p.q_end].transpose(0, 1)
            vv = v[p.q_start:p.q_end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qp, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kk = k_cache[p.block_ids].view(-1, hkv, d)[:p.context_len].transpose(0, 1)
            vv = v_cache[p.block_ids].view(-1, hkv, d)[:p.context_len].transpose(0, 1)
            # Query i sits at position context_len - ql + i and sees keys up to there.
            offset = p.context_len - ql
            qi = torch.arange(ql, device=q.device)[:, None] + offset
            kj = torch.arange(p.context_len, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qp, kk, vv, attn_mask=kj <= qi, scale=scale, enable_gqa=True)
        out[p.q_start:p.q_end] = o.transpose(0, 1)
    return out
