"""The stage-output cache: a stage's per-token outputs kept beside its KV blocks, on the host.

An omni pipeline passes each stage's per-token outputs (last hidden states, an intermediate layer's
states, any tensor whose first dimension is the number of tokens) to the next stage. With prefix
caching, the tokens of a prefix hit are never recomputed, so their outputs must come from somewhere:
this cache. It mirrors the KV cache's layout: one host tensor of shape (num_blocks, block_size, *D)
per output name, indexed by the very block ids and slots the KV cache uses. So it needs no index of
its own and no eviction policy: a block's rows are valid exactly as long as the block holds its hash
(when the block is reused, the forward that writes its new KV writes its new rows too), and a hit
found by the KV cache manager is a hit here.

Which outputs are cached is discovered at run time (no per-model list of names): every tensor whose
first dimension equals the step's token count, allocated the first time its name is seen, with its
own trailing shape and dtype.

Host KV tier: a block evicted from the device pool is sheltered under a host block id, and a host hit
is copied back into a *different* device block. The rows must follow, or the device block the copy
lands in would carry the rows of whatever it held before: `apply_swaps` executes the same swap plan
on the rows (host-side tensors shaped (num_host_blocks, block_size, *D)), swap-outs first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvpool.core.swap import SwapPlan


class StageOutputCache:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks/block_size: must be >= 1, got {num_blocks}/{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.tensors: dict[str, torch.Tensor] = {}  # name -> (num_blocks, block_size, *D)
        self.host_tensors: dict[str, torch.Tensor] = {}  # name -> (num_host_blocks, block_size, *D)
        self.rows_written = 0
        self.rows_read = 0

    def set_num_host_blocks(self, n: int) -> None:
        """Size the host-tier side (the runner calls this when it allocates its host KV tier)."""
        self.num_host_blocks = n
        self.host_tensors = {name: self._alloc(n, t.shape[2:], t.dtype) for name, t in self.tensors.items()}

    def _alloc(self, n: int, feature: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros((n, self.block_size, *feature), dtype=dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.tensors.values(), *self.host_tensors.values()))

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Slots of token positions [start, end) of a request whose block table is `block_ids`."""
        bs = self.block_size
        if end > len(block_ids) * bs or start < 0 or start > end:
            raise ValueError(f"positions [{start}, {end}) do not fit a table of {len(block_ids)} blocks")
        pos = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(list(block_ids), dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def write(self, outputs: Mapping[str, torch.Tensor], slot_mapping: torch.Tensor) -> list[str]:
        """Store every per-token output at its token's slot; returns the names stored.

        A tensor is per-token when its first dimension equals the number of slots; the others (a
        pooled vector, a scalar) are not the cache's business and are skipped.
        """
        n = int(slot_mapping.shape[0])
        slots = slot_mapping.to("cpu", torch.long)
        stored = []
        for name, t in outputs.items():
            if not isinstance(t, torch.Tensor) or t.ndim == 0 or t.shape[0] != n:
                continue
            cache = self.tensors.get(name)
            if cache is None:
                cache = self.tensors[name] = self._alloc(self.num_blocks, t.shape[1:], t.dtype)
                if self.num_host_blocks:
                    self.host_tensors[name] = self._alloc(self.num_host_blocks, t.shape[1:], t.dtype)
            elif cache.shape[2:] != t.shape[1:] or cache.dtype != t.dtype:
                raise ValueError(f"stage output {name!r}: shape {tuple(t.shape[1:])}/{t.dtype} per token, but "
                                 f"the cache holds {tuple(cache.shape[2:])}/{cache.dtype}")
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, t.detach().to("cpu"))
            stored.append(name)
        self.rows_written += n
        return stored

    def read(self, block_ids: Sequence[int], start: int, end: int) -> dict[str, torch.Tensor]:
        """The cached rows of token positions [start, end), every output name."""
        slots = self.slots(block_ids, start, end)
        self.rows_read += end - start
        return {name: t.view(-1, *t.shape[2:]).index_select(0, slots) for name, t in self.tensors.items()}

    def apply_swaps(self, plan: SwapPlan | None) -> None:
        """Make the rows follow the blocks the KV tier copies: device -> host, then host -> device."""
        if not plan or not self.tensors:
            return
        if self.num_host_blocks == 0:
            raise RuntimeError("swap plan given but the stage-output cache has no host side")
        if plan.swap_out:
            d = torch.tensor([d for d, _ in plan.swap_out], dtype=torch.long)
            h = torch.tensor([h for _, h in plan.swap_out], dtype=torch.long)
            for name, t in self.tensors.items():
                self.host_tensors[name].index_copy_(0, h, t.index_select(0, d))
        if plan.swap_in:
            h = torch.tensor([h for h, _ in plan.swap_in], dtype=torch.long)
            d = torch.tensor([d for _, d in plan.swap_in], dtype=torch.long)
            for name, t in self.tensors.items():
                t.index_copy_(0, d, self.host_tensors[name].index_select(0, h))
