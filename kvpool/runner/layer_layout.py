"""Which KV cache group each layer belongs to, and which physical KV tensor it uses.

Layers are grouped by the hybrid allocator's rule (`kvpool.core.grouping`: equal-size groups of one
spec each), so one block id means k layers' pages in every group. Group g's block ids then index k
shared tensors: the i-th layer of every group uses tensor i. Memory is k tensors of num_blocks blocks
however many groups there are; a sliding-window group holds only the blocks its window can see, so its
share of the pool stays small (Gemma-3: 15 sliding + 3 full layers -> six groups of 3, three tensors).
Cross-attention layers (Mllama) form groups of their own whose blocks hold the encoder tokens' K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.grouping import group_layers
from kvpool.core.kv_cache_spec import CrossAttentionSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


@dataclass(frozen=True)
class LayerLayout:
    group_of_layer: tuple[int, ...]
    tensor_of_layer: tuple[int, ...]
    specs: tuple[KVCacheSpec, ...]  # per group, for the KV cache manager
    layer_windows: tuple[int | None, ...]  # what each layer attends to (its group may keep more)

    @classmethod
    def from_windows(cls, layer_windows: list[int | None], block_size: int, num_kv_heads: int, head_size: int,
                     dtype_bytes: int, hybrid: bool = True, cross_layers: Sequence[int] = (),
                     max_encoder_tokens: int = 0) -> LayerLayout:
        """`layer_windows[i]`: layer i's sliding window, or None for full attention. `hybrid=False` is
        the uniform allocator the hybrid one is measured against: one full-attention group keeping every
        block of every layer (sliding layers still attend to their window only). `cross_layers` attend to
        at most `max_encoder_tokens` encoder tokens; they keep their own groups either way (their blocks
        hold encoder tokens, not text)."""
        common = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                      dtype_bytes=dtype_bytes)
        cross = set(cross_layers)
        layer_specs = [CrossAttentionSpec(**common, max_encoder_tokens=max_encoder_tokens) if i in cross
                       else FullAttentionSpec(**common) if w is None or not hybrid
                       else SlidingWindowSpec(**common, sliding_window=w) for i, w in enumerate(layer_windows)]
        return cls.from_specs(layer_specs, layer_windows)

    @classmethod
    def from_specs(cls, layer_specs: list[KVCacheSpec], layer_windows: list[int | None]) -> LayerLayout:
        """Any per-layer specs (models with state layers: `MambaSpec` among them)."""
        groups = group_layers(layer_specs)
        group_of = [0] * len(layer_specs)
        tensor_of = [0] * len(layer_specs)
        for g, group in enumerate(groups):
            for j, layer in enumerate(group.layers):
                group_of[layer], tensor_of[layer] = g, j
        return cls(tuple(group_of), tuple(tensor_of), tuple(g.spec for g in groups), tuple(layer_windows))

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    @property
    def cross_groups(self) -> frozenset[int]:
        """Groups of cross-attention layers: their tables follow encoder tokens, not positions."""
        return frozenset(g for g, s in enumerate(self.specs) if isinstance(s, CrossAttentionSpec))

    @property
    def layers_per_group(self) -> int:
        return max(self.tensor_of_layer) + 1

    def attention_views(self) -> tuple[list[tuple[int, int | None]], list[int]]:
        """The distinct (group, window) pairs layers attend through, and each layer's index into them:
        one per group on the hybrid allocator; in the uniform one, a group's layers may differ."""
        views: list[tuple[int, int | None]] = []
        of_layer = []
        for g, w in zip(self.group_of_layer, self.layer_windows, strict=True):
            if (g, w) not in views:
                views.append((g, w))
            of_layer.append(views.index((g, w)))
        return views, of_layer
