"""Block payloads for the store: the K/V of one block for every layer of its group, as bytes, from and to
the host tier's tensors (the runner's `host_kv_caches`: per layer a (K, V) pair shaped
(kv_heads, num_blocks, block_size, head_dim)).

Two-level host pools (models whose groups' pages differ in size: state layers beside attention) keep, per
page type, one (pages, page elements) tensor per tensor slot (the runner's `host_pages[t]`);
`gather_pages` / `scatter_pages` move one page of every slot, which is the page's group's K/V or state for
every layer of the group.

`gather` copies the bytes out at once, so a later swap that reuses the host block cannot change what is
written to the store (the write itself happens later, on the store worker's thread). `layout` names the
page layout for the fingerprint: a replica whose layers, heads, block size, head size, dtype or byte order
differ gets another fingerprint, and so never reads these bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from kvpool.runner.dtypes import indexable
from kvpool.store.base import Fingerprint, model_identity

Caches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def layout(caches: Caches, kv_layout: str = "standard") -> str:
    """The page layout in a fingerprint: shapes, dtype, byte order, and how a block orders its elements
    (`kv_layout`: the runner's, "standard", "packed16" or "packed8"; see ModelRunner.kv_layout)."""
    k = caches[0][0]
    heads, _, block, dim = k.shape
    text = f"L{len(caches)}:KV:{heads}x{block}x{dim}:{str(k.dtype).removeprefix('torch.')}:{sys.byteorder}"
    # "standard" adds nothing, so entries written before the packed layout existed stay readable.
    return text if kv_layout == "standard" else f"{text}:{kv_layout}"


def block_nbytes(caches: Caches) -> int:
    k = caches[0][0]
    heads, _, block, dim = k.shape
    return 2 * len(caches) * heads * block * dim * k.element_size()


def _split(rows: torch.Tensor) -> list[bytes]:
    """One bytes object per row of a (n, bytes) uint8 tensor."""
    raw = rows.numpy().tobytes()
    n = rows.shape[1]
    return [raw[i * n:(i + 1) * n] for i in range(rows.shape[0])]


def _joined(payloads: Sequence[bytes], want: int, what: str, dtype: torch.dtype) -> torch.Tensor:
    """The payloads, each checked to be `want` bytes (one `what` of this layout), as one flat tensor."""
    for p in payloads:
        if len(p) != want:
            raise ValueError(f"payload: {len(p)} bytes, a {what} of this layout has {want}")
    return torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(dtype)


def gather(caches: Caches, block_ids: Sequence[int]) -> list[bytes]:
    """One payload per block: layer by layer, K then V, each (kv_heads, block_size, head_dim) row-major."""
    if not block_ids:
        return []
    idx = torch.tensor(list(block_ids), dtype=torch.long)
    # (layers, 2, heads, n, block, dim) -> (n, layers, 2, heads, block, dim): one contiguous run per block.
    stacked = torch.stack([torch.stack((k.index_select(1, idx), v.index_select(1, idx))) for k, v in caches])
    return _split(stacked.permute(3, 0, 1, 2, 4, 5).contiguous().view(torch.uint8).reshape(len(block_ids), -1))


def scatter(caches: Caches, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Write payloads into the given host blocks (the inverse of `gather`)."""
    if not block_ids:
        return
    k0 = caches[0][0]
    heads, _, block, dim = k0.shape
    data = _joined(payloads, block_nbytes(caches), "block", k0.dtype)
    blocks = data.reshape(len(block_ids), len(caches), 2, heads, block, dim)
    idx = torch.tensor(list(block_ids), dtype=torch.long)
    for layer, (k, v) in enumerate(caches):
        indexable(k).index_copy_(1, idx, indexable(blocks[:, layer, 0].permute(1, 0, 2, 3)))
        indexable(v).index_copy_(1, idx, indexable(blocks[:, layer, 1].permute(1, 0, 2, 3)))


def fingerprint(model_dir: str | Path, caches: Caches, block_size: int, group: int = 0, *,
                kv_layout: str = "standard", compute: str = "") -> Fingerprint:
    return Fingerprint(model=model_identity(model_dir), dtype=str(caches[0][0].dtype).removeprefix("torch."),
                       block_size=block_size, group=group, layout=layout(caches, kv_layout), compute=compute)


Slots = Sequence[torch.Tensor]


def pages_layout(slots: Slots) -> str:
    """The page layout of one page type of a two-level host pool: slots, elements per page, dtype, byte order."""
    s = slots[0]
    return f"P{len(slots)}x{s.shape[1]}:{str(s.dtype).removeprefix('torch.')}:{sys.byteorder}"


def pages_nbytes(slots: Slots) -> int:
    return sum(s.shape[1] * s.element_size() for s in slots)


def gather_pages(slots: Slots, page_ids: Sequence[int]) -> list[bytes]:
    """One payload per page: slot by slot, the page's elements (a copy, like `gather`)."""
    if not page_ids:
        return []
    idx = torch.tensor(list(page_ids), dtype=torch.long)
    per_page = torch.stack([s.index_select(0, idx) for s in slots], dim=1).contiguous()  # (n, slots, elems)
    return _split(per_page.view(torch.uint8).reshape(len(page_ids), -1))


def scatter_pages(slots: Slots, page_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Write payloads into the given host pages (the inverse of `gather_pages`)."""
    if not page_ids:
        return
    s0 = slots[0]
    data = _joined(payloads, pages_nbytes(slots), "page", s0.dtype)
    pages = data.reshape(len(page_ids), len(slots), s0.shape[1])
    idx = torch.tensor(list(page_ids), dtype=torch.long)
    for i, s in enumerate(slots):
        s.index_copy_(0, idx, pages[:, i])
