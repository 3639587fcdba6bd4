"""Which KV cache group each layer belongs to, and which physical KV tensor it uses.

The hybrid allocator's grouping rule: layers of one type (full attention, or one sliding window) are
split into groups of equal size k, the same k for every type, so one block id means k layers' pages in
every group. Group g's block ids then index k shared tensors: the i-th layer of every group uses tensor
i. Memory is k tensors of num_blocks blocks however many groups there are; a sliding-window group only
holds the blocks its window can see, so its share of the pool stays small.
k is the greatest common divisor of the per-type layer counts, which needs no padding layers
(Gemma-3: 15 sliding + 3 full layers -> k = 3, six groups; a Llama: one group of all its layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpool.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


@dataclass(frozen=True)
class LayerLayout:
    group_of_layer: tuple[int, ...]
    tensor_of_layer: tuple[int, ...]
    group_windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention

    @classmethod
    def from_windows(cls, layer_windows: list[int | None]) -> LayerLayout:
        """`layer_windows[i]`: layer i's sliding window, or None for full attention."""
        if not layer_windows:
            raise ValueError("layers: a model needs at least one layer")
        kinds: dict[int | None, list[int]] = {}
        for i, w in enumerate(layer_windows):
            kinds.setdefault(w, []).append(i)
        k = math.gcd(*(len(v) for v in kinds.values()))
        group_of = [0] * len(layer_windows)
        tensor_of = [0] * len(layer_windows)
        windows: list[int | None] = []
        # Full attention first: group 0 is then the full-attention group whenever one exists.
        for w in sorted(kinds, key=lambda w: (w is not None, w or 0)):
            layers = kinds[w]
            for start in range(0, len(layers), k):
                for j, layer in enumerate(layers[start:start + k]):
                    group_of[layer] = len(windows)
                    tensor_of[layer] = j
                windows.append(w)
        return cls(tuple(group_of), tuple(tensor_of), tuple(windows))

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def layers_per_group(self) -> int:
        return max(self.tensor_of_layer) + 1

    def specs(self, block_size: int, num_kv_heads: int, head_size: int, dtype_bytes: int) -> list[KVCacheSpec]:
        """One spec per group, for the KV cache manager."""
        common = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                      dtype_bytes=dtype_bytes)
        return [FullAttentionSpec(**common) if w is None else SlidingWindowSpec(**common, sliding_window=w)
                for w in self.group_windows]
