"""The encoder cache: a multimodal encoder's outputs keyed by the input's content hash, LRU, bounded by bytes.

Prefix caching only ever reuses whole blocks, so an image straddling a block boundary past the hit
point still needs its embeddings for the tokens that are recomputed. This cache serves them without
running the encoder again: a seen image costs a dictionary lookup, not a forward through the tower.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"encoder_cache_size: must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @staticmethod
    def _size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor | None:
        t = self._entries.get(key)
        if t is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return t

    def put(self, key: str, value: torch.Tensor) -> None:
        """Insert (or refresh) an entry, evicting least recently used ones until it fits.

        An entry larger than the whole capacity is not kept: the caller still has it for this use.
        """
        size = self._size(value)
        if key in self._entries:
            self.used_bytes -= self._size(self._entries.pop(key))
        if size > self.capacity_bytes:
            return
        while self.used_bytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= self._size(old)
            self.evictions += 1
        self._entries[key] = value
        self.used_bytes += size

    def keys(self) -> list[str]:
        """Least recently used first."""
        return list(self._entries)
