"""Paged attention: K/V written through a slot mapping, read back through block tables.

`paged_attention` is the one attention op every model calls, so a fused GPU kernel can replace it
without touching a model. The cache of one layer is `(kv_heads, num_blocks, block_size, head_dim)`:
gathering a sequence's blocks for one head then yields its keys contiguously.

Cascade attention over shared prefixes: sequences whose block tables start with the same physical
blocks (a prefix hit makes them share) attend to that prefix together, in one kernel call whose keys
are read once for the whole group, instead of once per sequence. Each sequence then attends to the
rest of its context (its suffix) alone, and the two partial results are merged exactly through their
log-sum-exp. On the shared-prefix workloads prefix caching is for, this removes most of the memory
traffic of decoding.

Where kvpool's compiled CPU kernels load (kvpool.runner.kernels), they take over: decode rows always,
multi-token chunks in bf16. They read every key in place through the block table, so the rows they
serve need no cascade, gather or mask; in bf16, decode rows of sequences sharing a prefix still read
its keys once for the whole group. The torch code here remains the path for everything else (fp16,
other head sizes, batch-invariant mode, machines without a compiler) and the reference the kernels
are tested against. Off the CPU (a GPU) the CPU's flash op with its log-sum-exp does not exist: a chunk
outside any cascade goes through the public SDPA with its mask, and a cascade's partials through
`attention_lse_math` (cascades are off by default there: see ModelRunner).

Which of these paths a step takes is the runner's choice, made once at start: an attention backend
(kvpool.runner.attention_backends) plans each step's metadata and runs the attention of every layer
that reads it; `paged_attention` hands the call to the backend that planned the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvpool.runner.dtypes import indexable, round_to
from kvpool.runner.invariant import MIN_ROWS

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# Below this many shared tokens a cascade costs more than it saves.
MIN_CASCADE_TOKENS = 64


@dataclass
class SeqAttn:
    q_start: int  # rows of this sequence's queries in the step's token batch: [q_start, q_end)
    q_end: int
    context_len: int  # tokens in the cache once this step's tokens are written (queries included)
    # (ceil(context_len / block_size),) long; None: built from `ids` on first use (`blocks()`), since the
    # kernels' planners read the list and only the torch paths need a tensor.
    block_ids: torch.Tensor | None
    prefix_len: int = 0  # leading tokens attended through its cascade group (0: none)
    # First block this sequence reads by itself: after its cascade prefix, or where its window starts.
    first_block: int = 0
    bias: torch.Tensor | None = None  # causal mask over its suffix keys, as an additive bias (see plan_masks)
    # The same block ids as a Python list, when the planner has one: planning reads them per sequence, and
    # indexing a list costs far less than a tensor op (64 decode rows: 1.53 -> 0.43 ms of metadata a step).
    ids: list[int] | None = None
    device: torch.device | None = None  # where `blocks()` builds the tensor

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start

    def table(self) -> list[int]:
        if self.ids is None:
            self.ids = self.blocks().tolist()
        return self.ids

    def blocks(self) -> torch.Tensor:
        if self.block_ids is None:
            assert self.ids is not None, "a sequence needs its block ids as a tensor or a list"
            self.block_ids = torch.tensor(self.ids, dtype=torch.long, device=self.device)
        return self.block_ids


@dataclass
class CascadeGroup:
    prefix_len: int  # tokens shared by every member, a whole number of blocks
    prefix_block_ids: torch.Tensor
    members: list[int]  # indices into AttentionMetadata.seqs
    rows: torch.Tensor  # the members' query rows, in member order
    # Blocks allocated in one run are consecutive ids: then the prefix is a view, not a copy.
    first_block: int | None = None


@dataclass
class AttentionMetadata:
    """Where each token of the step goes in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # (T,) long: block_id * block_size + offset for every token
    seqs: list[SeqAttn] = field(default_factory=list)
    groups: list[CascadeGroup] = field(default_factory=list)
    # Single-query sequences, batched for their suffix: built once per step, shared by every layer.
    decode_seqs: list[int] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None  # (B,) query rows
    decode_tables: torch.Tensor | None = None  # (B, W) suffix block ids, padded with block 0
    decode_mask: torch.Tensor | None = None  # (B, W * block_size) True where a key is visible
    decode_lows: torch.Tensor | None = None  # (B,) first visible key, counted from the table's first block
    decode_lens: torch.Tensor | None = None  # (B,) keys up to here, same origin
    # Grouped decode kernel (bf16, full attention): rows decode_group_starts[i]..[i+1] share their first
    # decode_shared[i] keys (None: no groups this step).
    decode_group_starts: torch.Tensor | None = None
    decode_shared: torch.Tensor | None = None
    # Multi-token chunks through the compiled flash kernel (bf16): no cascades, masks or gathers for them.
    prefill_args: tuple[torch.Tensor, ...] = ()  # q_starts, q_lens, ctx_lens, tables: see plan_prefill_batch
    # Sliding-window layers: each query sees the `window` most recent positions, itself included.
    window: int | None = None
    # The attention backend that planned this metadata: `paged_attention` runs its forward.
    backend: Any = None


def shared_prefix_groups(seqs: list[SeqAttn], candidates: list[int], block_size: int, min_tokens: int
                         ) -> list[tuple[list[int], int]]:
    """Sequences (among `candidates`) whose tables start with the same physical blocks, at least
    `min_tokens` of them and all before every member's first query: (members, shared blocks) each."""
    by_first: dict[int, list[int]] = {}
    for i in candidates:
        s = seqs[i]
        if s.context_len - s.num_queries >= min_tokens and s.table():
            by_first.setdefault(s.table()[0], []).append(i)
    out = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        tables = [seqs[i].table() for i in members]
        limit = min((seqs[i].context_len - seqs[i].num_queries) // block_size for i in members)
        limit = min(limit, *(len(t) for t in tables))
        first = tables[0]
        n = limit
        for t in tables[1:]:
            if t[:n] != first[:n]:
                n = next(j for j in range(n) if t[j] != first[j])
        if n * block_size >= min_tokens:
            out.append((members, n))
    return out


def plan_cascades(meta: AttentionMetadata, block_size: int, min_tokens: int = MIN_CASCADE_TOKENS, *,
                  skip_decodes: bool = False, skip_chunks: bool = False) -> None:
    """Group sequences sharing leading physical blocks; set each member's `prefix_len`.

    A member's queries must all lie after the shared prefix, so the prefix is fully visible to them.
    Not for sliding-window layers: their shared prefix soon falls out of the window. Rows a compiled
    kernel serves (`skip_decodes`: single queries; `skip_chunks`: multi-token chunks) read their whole
    context in place and join no group.
    """
    if meta.window is not None:
        return
    candidates = [i for i, s in enumerate(meta.seqs) if not (skip_decodes if s.num_queries == 1 else skip_chunks)]
    for members, n in shared_prefix_groups(meta.seqs, candidates, block_size, min_tokens):
        first = meta.seqs[members[0]].blocks()
        for i in members:
            meta.seqs[i].prefix_len = n * block_size
            meta.seqs[i].first_block = n
        rows = torch.cat([torch.arange(meta.seqs[i].q_start, meta.seqs[i].q_end) for i in members])
        ids = first[:n].clone()
        start = int(ids[0])
        run = bool(torch.equal(ids, torch.arange(start, start + n, device=ids.device)))
        meta.groups.append(CascadeGroup(n * block_size, ids, members, rows.to(meta.slot_mapping.device),
                                        start if run else None))


def padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one (len(tables), longest) long tensor, padded with block 0. Filled row by row
    through numpy: `torch.tensor` of nested lists costs ~0.1 us an element (32 tables of 68 blocks: 0.21 ms,
    against 0.06-0.13 ms here), and a hybrid model pads one such batch per group every step."""
    width = max(map(len, tables))
    arr = np.zeros((len(tables), width), dtype=np.int64)
    for row, t in zip(arr, tables, strict=True):
        row[:len(t)] = t
    return torch.from_numpy(arr).to(device)


def plan_windows(meta: AttentionMetadata, block_size: int) -> None:
    """Sliding-window layers: each sequence reads from the block holding the oldest key its first query
    sees. Older blocks may be the null block already (the window manager released them)."""
    if meta.window is None:
        return
    for s in meta.seqs:
        s.first_block = max(0, s.context_len - s.num_queries - meta.window + 1) // block_size


def plan_decode_batch(meta: AttentionMetadata, block_size: int, *, kernel: bool = False, grouped: bool = False
                      ) -> None:
    """Batch the single-query sequences' suffixes (context after their cascade prefix). `kernel`: for the
    compiled decode kernel (no mask); `grouped`: for its grouped form (full attention only)."""
    idx = [i for i, s in enumerate(meta.seqs) if s.num_queries == 1]
    if not idx:
        return
    dev = meta.slot_mapping.device
    if kernel and grouped and meta.window is None:
        # Every decode row goes through kvpool::paged_decode_grouped, in groups of sequences
        # sharing a prefix (its keys read once for all of them) or alone. Its arithmetic per row does not
        # depend on the grouping, so tokens come out the same with prefix caching on or off.
        groups = shared_prefix_groups(meta.seqs, idx, block_size, MIN_CASCADE_TOKENS)
        in_group = {i for members, _ in groups for i in members}
        groups += [([i], 0) for i in idx if i not in in_group]
        idx = [i for members, _ in groups for i in members]
        starts = [0]
        for members, _ in groups:
            starts.append(starts[-1] + len(members))
        meta.decode_group_starts = torch.tensor(starts, dtype=torch.long, device=dev)
        meta.decode_shared = torch.tensor([n * block_size for _, n in groups], dtype=torch.long, device=dev)
    tables = []
    lens = []
    lows = []
    for i in idx:
        s = meta.seqs[i]
        tables.append(s.table()[s.first_block: -(-s.context_len // block_size)])
        lens.append(s.context_len - s.first_block * block_size)
        lows.append(0 if meta.window is None else max(0, lens[-1] - meta.window))
    padded = padded_tables(tables, dev)
    pos = torch.arange(padded.shape[1] * block_size, device=dev)
    meta.decode_seqs = idx
    meta.decode_rows = torch.tensor([meta.seqs[i].q_start for i in idx], dtype=torch.long, device=dev)
    meta.decode_tables = padded
    meta.decode_lens = torch.tensor(lens, dtype=torch.long, device=dev)
    meta.decode_lows = torch.tensor(lows, dtype=torch.long, device=dev)
    if kernel:
        return
    meta.decode_mask = pos[None, :] < meta.decode_lens[:, None]
    if meta.window is not None:
        meta.decode_mask &= pos[None, :] >= meta.decode_lows[:, None]


def plan_prefill_batch(meta: AttentionMetadata, *, decode_rows: bool = False) -> None:
    """The multi-token chunks' rows, context lengths and whole block tables, for the prefill kernel
    (`decode_rows`: the single-query sequences' too)."""
    idx = [i for i, s in enumerate(meta.seqs) if decode_rows or s.num_queries > 1]
    if not idx:
        return
    dev = meta.slot_mapping.device
    tables = padded_tables([meta.seqs[i].table() for i in idx], dev)
    cols = [[meta.seqs[i].q_start, meta.seqs[i].num_queries, meta.seqs[i].context_len] for i in idx]
    starts, lens, ctx = torch.tensor(cols, dtype=torch.long, device=dev).t().contiguous()
    meta.prefill_args = (starts, lens, ctx, tables)


def plan_masks(meta: AttentionMetadata, dtype: torch.dtype, group: int, block_size: int) -> None:
    """Once per step, for every multi-token chunk with cached context (or longer than its window): the
    additive causal (and window) bias over the keys it reads itself, rows repeated for the `group`
    query heads of a kv head."""
    w = meta.window
    for s in meta.seqs:
        ql = s.num_queries
        if ql == 1 or (s.context_len == ql and (w is None or ql <= w)):
            continue
        n_keys = s.context_len - s.first_block * block_size
        dev = meta.slot_mapping.device
        # Query i sits at position context_len - ql + i and sees keys up to there (and, in a window,
        # no further back than window - 1 positions).
        qi = torch.arange(ql, device=dev)[:, None] + (n_keys - ql)
        kj = torch.arange(n_keys, device=dev)[None, :]
        hidden = kj > qi if w is None else (kj > qi) | (kj <= qi - w)
        bias = torch.zeros((ql, n_keys), dtype=dtype, device=dev).masked_fill_(hidden, float("-inf"))
        s.bias = bias.repeat(group, 1)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V (T, kv_heads, head_dim) at their slots (rounded to the caches' dtype)."""
    h, nb, bs, d = k_cache.shape
    k, v = round_to(k, k_cache.dtype), round_to(v, v_cache.dtype)
    if not k_cache.is_contiguous():
        # Block-major pages (a pool shared with state layers, see kvpool.runner.state_cache).
        blk, off = slot_mapping // bs, slot_mapping % bs
        k_cache.transpose(0, 1)[blk, :, off] = k
        v_cache.transpose(0, 1)[blk, :, off] = v
        return
    indexable(k_cache).view(h, nb * bs, d).index_copy_(1, slot_mapping, indexable(k).transpose(0, 1))
    indexable(v_cache).view(h, nb * bs, d).index_copy_(1, slot_mapping, indexable(v).transpose(0, 1))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(kv_heads, n * block_size, head_dim): the keys (or values) of the given blocks, in order (as `dtype`,
    the queries', where the cache holds another: see `kv_cache_dtype`)."""
    h, nb, bs, d = cache.shape
    # index_select copies whole blocks; advanced indexing is several times slower on the CPU.
    out = cache.view(h, nb, bs * d).index_select(1, block_ids.reshape(-1)).view(h, -1, d)
    return out if dtype is None or dtype == out.dtype else out.to(dtype)


def as_cached(k: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """A step's own keys (or values) as attention reads them back from `cache`: rounded to its dtype, in
    theirs. A chunk attending to its own keys must see what a later chunk, or a prefix hit, will read."""
    return k if k.dtype == cache.dtype else round_to(k, cache.dtype).to(k.dtype)


def _fold(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """(n, heads, d) -> (1, kv_heads, group * n, d): a kv head's query heads become extra rows."""
    n, h, d = q.shape
    return q.view(n, hkv, h // hkv, d).permute(1, 2, 0, 3).reshape(1, hkv, -1, d)


def _unfold(o: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of _fold for outputs (1, kv_heads, group * n, d) -> (n, heads, d); LSE too."""
    hkv = o.shape[1]
    if o.dim() == 3:  # lse: (1, kv_heads, group * n)
        return o.view(hkv, -1, n).permute(2, 0, 1).reshape(n, -1)
    d = o.shape[-1]
    return o.view(hkv, -1, n, d).permute(2, 0, 1, 3).reshape(n, -1, d)


def _off_cpu(t: torch.Tensor) -> bool:
    """Whether `t` lives where `_flash`, a CPU-only op, cannot run (a test forces the other devices' paths)."""
    return t.device.type != "cpu"


def _flash_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (n, heads, d) over keys (kv_heads, L, d): outputs (n, heads, d) and LSE (n, heads).

    `bias` is an additive mask over the folded rows (group * n, L), as `plan_masks` builds it."""
    n = q.shape[0]
    qf = _fold(q, k.shape[0])
    if _off_cpu(qf):
        o, lse = attention_lse_math(qf, k, v, scale, bias)
    else:
        o, lse = _flash(qf, k[None], v[None], 0.0, False, attn_mask=bias, scale=scale)[:2]
    return _unfold(o, n), _unfold(lse, n)


def attention_lse_math(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Folded queries (1, kv_heads, rows, d) over keys (kv_heads, L, d), by the definition, in fp32: outputs
    (1, kv_heads, rows, d) in the queries' dtype and LSE (1, kv_heads, rows) fp32.

    The path of devices other than the CPU, whose flash op with an LSE (`_flash`) is CPU-only; the public
    SDPA returns no LSE, and the cascade's merge needs it. A row that every key is masked from gets a zero
    output and an LSE of -inf, so a merge gives it no weight. (Null blocks are never passed in: the planner
    gathers a window's keys from its first block on.)"""
    s = torch.matmul(qf[0].float(), k.float().transpose(-1, -2)) * scale  # (kv_heads, rows, L)
    if bias is not None:
        s = s + bias.float()
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    o = torch.matmul(p, v.float()).to(qf.dtype)
    return o[None], lse[None]


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets from their outputs and log-sum-exps."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return o1.float() * w1 + o2.float() * w2, lse


def _decode_suffix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Single queries over their own (post-prefix) context: outputs (B, heads, d) fp32, LSE (B, heads)."""
    tables, mask, rows = meta.decode_tables, meta.decode_mask, meta.decode_rows
    assert tables is not None and mask is not None and rows is not None
    b, w = tables.shape
    hkv, _, bs, d = k_cache.shape
    qq = q[rows].float()
    h = qq.shape[1]
    kk = gather_blocks(k_cache, tables).view(hkv, b, w * bs, d).float()  # (Hkv, B, L, d)
    vv = gather_blocks(v_cache, tables).view(hkv, b, w * bs, d).float()
    qk = qq.view(b, hkv, h // hkv, d).transpose(0, 1)  # (Hkv, B, G, d)
    s = torch.matmul(qk, kk.transpose(-1, -2)) * scale  # (Hkv, B, G, L)
    s.masked_fill_(~mask[None, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (Hkv, B, G)
    o = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), vv)  # (Hkv, B, G, d)
    return o.transpose(0, 1).reshape(b, h, d), lse.transpose(0, 1).reshape(b, h)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, heads, head_dim); k, v: (T, kv_heads, head_dim). Returns (T, heads, head_dim).

    Every token's K/V is written before any sequence reads, so a sequence may attend to blocks that
    another sequence of the same step computes (a prefix hit on blocks cached at allocation time).
    The backend that planned `meta` computes it (see kvpool.runner.attention_backends).
    """
    return meta.backend.forward(q, k, v, k_cache, v_cache, meta, scale)


def torch_decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor, acc: torch.Tensor | None, lse: torch.Tensor | None) -> None:
    """The step's decode rows over their suffixes, in torch; their fp32 partials into acc/lse when grouped."""
    o, l_ = _decode_suffix(q, k_cache, v_cache, meta, scale)
    rows = meta.decode_rows
    assert rows is not None
    out[rows] = o.to(q.dtype)  # rows in a cascade group are overwritten by the merge below
    if acc is not None and lse is not None:
        acc[rows] = o
        lse[rows] = l_


def torch_chunk_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                     acc: torch.Tensor | None, lse: torch.Tensor | None) -> None:
    """The step's multi-token chunks, one sequence at a time, in torch (cascade members' suffixes into
    acc/lse, merged with their prefix by `merge_cascades`)."""
    k, v = as_cached(k, k_cache), as_cached(v, v_cache)
    for s in meta.seqs:
        ql = s.num_queries
        if ql == 1:
            continue
        qs = q[s.q_start:s.q_end]
        if s.context_len == ql and s.bias is None:
            # No cached context (so never in a cascade group) and no window to cut it: causal attention
            # over the chunk's own K/V, as computed. No log-sum-exp needed: the public kernel, faster here.
            o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], k[s.q_start:s.q_end].transpose(0, 1)[None],
                                               v[s.q_start:s.q_end].transpose(0, 1)[None], is_causal=True,
                                               scale=scale, enable_gqa=True)
            out[s.q_start:s.q_end] = o[0].transpose(0, 1)
            continue
        first = s.first_block
        n_keys = s.context_len - first * k_cache.shape[2]
        kk = gather_blocks(k_cache, s.blocks()[first:], q.dtype)[:, :n_keys]
        vv = gather_blocks(v_cache, s.blocks()[first:], q.dtype)[:, :n_keys]
        assert s.bias is not None, "plan_masks must run once per step before the forward"
        if acc is not None and lse is not None and s.prefix_len:
            o, l_ = _flash_lse(qs, kk, vv, scale, s.bias)
            acc[s.q_start:s.q_end] = o.float()
            lse[s.q_start:s.q_end] = l_
        elif _off_cpu(qs):
            out[s.q_start:s.q_end] = masked_chunk_attention(qs, kk, vv, scale, s.bias[:ql])  # unrepeated rows
        else:
            out[s.q_start:s.q_end] = _flash_lse(qs, kk, vv, scale, s.bias)[0]


def masked_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           bias: torch.Tensor) -> torch.Tensor:
    """Queries (n, heads, d) over keys (kv_heads, L, d) under an additive bias (n, L), through the public
    SDPA: what a chunk outside any cascade needs off the CPU, where SDPA has fused masked kernels and no
    (n x L) fp32 scores need materializing (a 2,048-token chunk over 32K keys: 2.4 GB per layer)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=bias.to(q.dtype),
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def merge_cascades(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, out: torch.Tensor, acc: torch.Tensor, lse: torch.Tensor) -> None:
    """Each cascade group's queries over its shared prefix, once, merged with the members' suffixes."""
    for g in meta.groups:
        if g.first_block is not None:
            h, _, bs, d = k_cache.shape
            end = g.first_block + g.prefix_len // bs
            kp = k_cache[:, g.first_block:end].reshape(h, -1, d).to(q.dtype)  # a view: blocks are adjacent
            vp = v_cache[:, g.first_block:end].reshape(h, -1, d).to(q.dtype)
        else:
            kp = gather_blocks(k_cache, g.prefix_block_ids, q.dtype)
            vp = gather_blocks(v_cache, g.prefix_block_ids, q.dtype)
        o_p, l_p = _flash_lse(q[g.rows], kp, vp, scale)
        merged, _ = _merge(acc[g.rows], lse[g.rows], o_p, l_p)
        out[g.rows] = merged.to(q.dtype)


# Keys per reduction step of `invariant_attention`, at absolute positions 0, C, 2C, ...
INVARIANT_CHUNK = 64


def invariant_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """Attention whose result for a query depends only on its position and the cached keys, never on
    how the step batched it: which other sequences ran, how the prompt was chunked, whether its
    prefix was a cache hit or computed in the same step.

    The fast paths above are not like that: the fused kernels split queries and keys into blocks
    whose sizes follow the sequence length, so a row's floating-point sums come out in a different
    order when the same prefix is computed within a longer prompt. Here every query reduces over
    the keys in fixed chunks of INVARIANT_CHUNK at absolute positions, with an online softmax in
    chunk order, in fp32; keys after the query (the causal mask, padding) contribute exact zeros.
    What remains assumed is that a matmul's row does not depend on the number of rows (checked by
    the omni tests against recomputation). Omni stages use it so the next stage receives the same
    bits with the stage-output cache on or off.
    """
    hkv, _, _, d = k_cache.shape
    h = q.shape[1]
    g = h // hkv
    c = INVARIANT_CHUNK
    out = torch.empty_like(q)
    for s in meta.seqs:
        n, ctx = s.num_queries, s.context_len
        qs = q[s.q_start:s.q_end].float().view(n, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n * g, d)
        rows = n * g
        # At least MIN_ROWS rows per matmul (see kvpool.runner.invariant); padded rows sit at position 0.
        pad = max(0, MIN_ROWS - rows)
        qs = F.pad(qs, (0, 0, 0, pad))
        span = -(-ctx // c) * c
        kk = gather_blocks(k_cache, s.blocks()).float()
        vv = gather_blocks(v_cache, s.blocks()).float()
        if kk.shape[1] < span:
            kk = F.pad(kk, (0, 0, 0, span - kk.shape[1]))
            vv = F.pad(vv, (0, 0, 0, span - vv.shape[1]))
        qpos = torch.arange(ctx - n, ctx, device=q.device).repeat_interleave(g)  # rows are (query, group)
        qpos = F.pad(qpos, (0, pad))
        m = torch.full((hkv, rows + pad), float("-inf"), device=q.device)
        l_ = torch.zeros((hkv, rows + pad), device=q.device)
        acc = torch.zeros((hkv, rows + pad, d), device=q.device)
        for c0 in range(0, ctx, c):
            sc = torch.matmul(qs, kk[:, c0:c0 + c].transpose(1, 2)) * scale  # (hkv, n * g, c)
            kpos = torch.arange(c0, c0 + c, device=q.device)
            sc.masked_fill_((kpos[None, :] > qpos[:, None])[None], float("-inf"))
            # Chunk 0 holds key 0, visible to every query: m is finite from then on, no NaN below.
            m_new = torch.maximum(m, sc.amax(-1))
            p = torch.exp(sc - m_new[..., None])
            alpha = torch.exp(m - m_new)
            l_ = l_ * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p, vv[:, c0:c0 + c])
            m = m_new
        o = (acc / l_[..., None])[:, :rows]
        out[s.q_start:s.q_end] = o.view(hkv, n, g, d).permute(1, 0, 2, 3).reshape(n, h, d).to(q.dtype)
    return out
