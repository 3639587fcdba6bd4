"""From a model's per-layer specs to layer groups: the layers that share one block table.

The hybrid allocator RFC's rule: layers in a group have the same spec (so the same tokens in their
blocks), and every group has the same number of layers. Then one page of a group (one block of each
of its layers) has the same size for every group whose layers have equal per-layer pages, and one
pool of equal pages serves them all. The group size is the gcd of the layer counts of the types, so
no group is padded; e.g. mllama 11B (8 cross-attention, 32 self-attention layers) gives 5 groups of 8.
Types whose per-layer pages differ (a Mamba state and an attention block) still get equal layer
counts; their groups' page sizes differ and need the two-level pool (`kvpool.core.two_level_pool`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvpool.core.kv_cache_spec import KVCacheSpec, SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table: `layers` are indices into the model's layer list."""

    spec: KVCacheSpec
    layers: tuple[int, ...]

    @property
    def page_size_bytes(self) -> int:
        """One block of the group: one page of each of its layers."""
        return self.spec.page_size_bytes * len(self.layers)


def group_layers(layer_specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers of equal spec into groups of equal layer count, in the order of their first layer."""
    if not layer_specs:
        raise ValueError("layer_specs: a model needs at least one layer")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(layer_specs):
        if not isinstance(spec, KVCacheSpec):
            raise ValueError(f"layer_specs: layer {i} is {type(spec).__name__}, not a KVCacheSpec")
        by_spec.setdefault(spec, []).append(i)
    block_sizes = {s.block_size for s in by_spec}
    if len(block_sizes) > 1:
        raise ValueError(f"layer_specs: all layers need one block_size, got {sorted(block_sizes)}")
    size = math.gcd(*(len(v) for v in by_spec.values()))
    groups = [KVCacheGroup(spec, tuple(layers[k:k + size]))
              for spec, layers in by_spec.items() for k in range(0, len(layers), size)]
    groups.sort(key=lambda g: g.layers[0])
    if len(groups) == 1 and isinstance(groups[0].spec, SlidingWindowSpec):
        # Alone, no other group cuts its prefix hits short: its admission bound is one window smaller
        # (see SlidingWindowSpec.only_group), which is room for a longer request or more pinned blocks.
        groups[0] = KVCacheGroup(replace(groups[0].spec, only_group=True), groups[0].layers)
    return groups


def common_page_size(groups: Sequence[KVCacheGroup]) -> int | None:
    """The one page size every group has, or None when they differ (two-level pages needed)."""
    sizes = {g.page_size_bytes for g in groups}
    return sizes.pop() if len(sizes) == 1 else None
