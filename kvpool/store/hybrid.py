"""The store tier for models with several layer groups (hybrid models: Gemma-3's sliding-window and full
attention groups, LFM2's conv-state and attention groups): which point of a prompt the store can restore
for every group, what that needs from the store, and where each payload lands.

The rule is the host tier's (`KVCacheManager._hybrid_hit`): a hit at block boundary p restores every group
of the prefix, or it is no hit. Per group, what boundary p needs (`HitRule`):
- full attention: every block before p;
- sliding window: the `window_blocks` blocks right before p (all of them when p is shorter than a window);
- state (Mamba, short convolutions): the state at p, which is block p - 1's page;
- cross attention: nothing (its blocks follow the encoder, never a prefix).
`hit_point` is the largest p every group accepts, given per group and block which blocks are available
(in the device or host tier, or in the store). The engine computes it twice: on its own tiers (the local
hit, as the scheduler's lookup will find it), then on the worker thread with what one EXISTS round trip
says the store holds; it then reads exactly the blocks p needs that no local tier has, in one MGET, and
lands them in the host pool of their page type, where the ordinary lookup finds them as host hits. A
block that fails its checksum is a miss: the ordinary lookup then finds a shorter point every group can
serve, never a hit one group cannot.

Keys: a store key is the host tier's key (`group_key`: group 0's block hash, or the hash followed by the
group byte), under one fingerprint whose layout names every group (its spec, its layers and their tensor
slots, its page type) and every page type's byte layout. So groups and page types never collide, and a
replica whose grouping, windows, state shapes or pages differ never addresses these values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kvpool.core.kv_cache_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvpool.store.base import BlockStore, Fingerprint, model_identity
from kvpool.store.blocks import (
    Caches,
    Slots,
    block_nbytes,
    gather,
    gather_pages,
    layout,
    pages_layout,
    pages_nbytes,
    scatter,
    scatter_pages,
)

FULL, SLIDING, STATE, NONE = "full", "sliding", "state", "none"


@dataclass(frozen=True)
class HitRule:
    """What one group needs for a prefix hit at a block boundary (see the module doc)."""

    kind: str  # FULL, SLIDING, STATE or NONE
    window_blocks: int = 0  # SLIDING: cached blocks needed right before the point

    @classmethod
    def of(cls, spec: KVCacheSpec) -> HitRule:
        if isinstance(spec, SlidingWindowSpec):
            return cls(SLIDING, spec.window_blocks)
        if isinstance(spec, MambaSpec):
            return cls(STATE)
        if isinstance(spec, CrossAttentionSpec):
            return cls(NONE)
        if isinstance(spec, FullAttentionSpec):
            return cls(FULL)
        raise ValueError(f"kv_store: no store rule for {type(spec).__name__} layers")

    def needed(self, p: int) -> range:
        """The block indices a hit at boundary p needs from this group."""
        if p <= 0 or self.kind == NONE:
            return range(0)
        if self.kind == FULL:
            return range(p)
        if self.kind == SLIDING:
            return range(max(0, p - self.window_blocks), p)
        return range(p - 1, p)  # STATE

    def candidates(self, local_point: int, limit: int) -> range:
        """Blocks that can matter for a hit at some p in (local_point, limit]."""
        if self.kind == NONE:
            return range(0)
        if self.kind == FULL:
            return range(limit)
        if self.kind == SLIDING:
            return range(max(0, local_point + 1 - self.window_blocks), limit)
        return range(local_point, limit)  # STATE: block p - 1 for p > local_point


def hit_point(rules: Sequence[HitRule], avail: Sequence[Sequence[bool]], limit: int) -> int:
    """The largest block boundary p <= limit at which every group has what a hit needs; `avail[g][i]`:
    whether group g's block i is available (i < limit). 0 when no boundary past 0 works for all."""
    checks: list[Callable[[int], bool]] = []
    for rule, a in zip(rules, avail, strict=True):
        if rule.kind == NONE:
            continue
        if rule.kind == FULL:
            run = 0
            while run < limit and a[run]:
                run += 1
            checks.append(lambda p, run=run: p <= run)
        elif rule.kind == SLIDING:
            ends = [0] * limit  # ends[i]: available blocks in a row ending at block i
            for i in range(limit):
                ends[i] = (ends[i - 1] + 1 if i else 1) if a[i] else 0
            w = rule.window_blocks
            checks.append(lambda p, ends=ends, w=w: ends[p - 1] >= min(w, p))
        else:
            checks.append(lambda p, a=a: bool(a[p - 1]))
    for p in range(limit, 0, -1):
        if all(ok(p) for ok in checks):
            return p
    return 0


class HostPages(Protocol):
    """One page type of the host tier, as bytes: the payload of a block is its page in every tensor."""

    nbytes: int
    layout: str

    def gather(self, ids: Sequence[int]) -> list[bytes]: ...

    def scatter(self, ids: Sequence[int], payloads: Sequence[bytes]) -> None: ...


class KVPages:
    """A one-page-size host tier (`ModelRunner.host_kv_caches`): per tensor slot a (K, V) pair; a block id
    is one page of every slot, holding its group's layers' K/V (Gemma-3's groups share the slots)."""

    def __init__(self, caches: Caches, kv_layout: str = "standard") -> None:
        self.caches = caches
        self.nbytes = block_nbytes(caches)
        self.layout = layout(caches, kv_layout)

    def gather(self, ids: Sequence[int]) -> list[bytes]:
        return gather(self.caches, ids)

    def scatter(self, ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        scatter(self.caches, ids, payloads)


class SlotPages:
    """One page type of a two-level host tier (`ModelRunner.host_pages[t]`): per tensor slot a
    (pages, page elements) tensor; a page holds its group's layers' K/V or states."""

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        self.nbytes = pages_nbytes(slots)
        self.layout = pages_layout(slots)

    def gather(self, ids: Sequence[int]) -> list[bytes]:
        return gather_pages(self.slots, ids)

    def scatter(self, ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        scatter_pages(self.slots, ids, payloads)


def group_layout(specs: Sequence[KVCacheSpec], group_of_layer: Sequence[int], tensor_of_layer: Sequence[int],
                 page_type: Sequence[int], pages: Sequence[HostPages]) -> str:
    """The fingerprint's layout of a multi-group model: per group its spec (type, heads, head size, window
    or state shapes, dtype bytes), its layers and their tensor slots, its page type; per page type its
    byte layout."""
    if len(group_of_layer) != len(tensor_of_layer):
        raise ValueError("kv_store: group_of_layer and tensor_of_layer differ in length")
    parts = []
    for g, spec in enumerate(specs):
        layers = [i for i, x in enumerate(group_of_layer) if x == g]
        slots = [tensor_of_layer[i] for i in layers]
        parts.append(f"g{g}={spec!r}@layers{layers}slots{slots}type{page_type[g]}")
    parts += [f"t{t}={p.layout}" for t, p in enumerate(pages)]
    return "groups;" + ";".join(parts)


def hybrid_fingerprint(model_dir: str | Path, dtype: torch.dtype, block_size: int, specs: Sequence[KVCacheSpec],
                       group_of_layer: Sequence[int], tensor_of_layer: Sequence[int], page_type: Sequence[int],
                       pages: Sequence[HostPages], compute: str = "") -> Fingerprint:
    # group=-1: the value's group is in its key (the host tier's group_key), every group in the layout.
    return Fingerprint(model=model_identity(model_dir), dtype=str(dtype).removeprefix("torch."),
                       block_size=block_size, group=-1,
                       layout=group_layout(specs, group_of_layer, tensor_of_layer, page_type, pages), compute=compute)


@dataclass
class ReadPlan:
    """A request's store read, decided on the engine thread up to what only the store can answer."""

    rules: Sequence[HitRule]
    local: list[list[bool]]  # per group and block: in the device or host tier now
    local_point: int  # the hit the local tiers give (what the scheduler's lookup would find)
    limit: int  # the longest hit allowed (the last prompt token is always recomputed)
    keys: list[list[bytes]]  # per group and block: its store key (the host tier's key)
    page_type: Sequence[int]  # per group

    def candidates(self) -> list[bytes]:
        """Keys not in any local tier that some hit past the local one could need."""
        out = []
        for g, rule in enumerate(self.rules):
            out += [self.keys[g][i] for i in rule.candidates(self.local_point, self.limit) if not self.local[g][i]]
        return out

    def needed_from_store(self) -> int:
        """Values a hit at `limit` would read (what no local tier holds of what every group needs there):
        the size of the read the job makes when the store has them."""
        return sum(1 for g, rule in enumerate(self.rules) for i in rule.needed(self.limit) if not self.local[g][i])

    def job(self, candidates: list[bytes], owned: list[bytes]) -> Callable[[BlockStore], list[Any]]:
        """The worker-thread read: one EXISTS over the candidates, the hit point with what the store holds,
        then one GET of the owned keys that point needs. Per owned key: (page type, group, payload) or
        None."""
        where = {self.keys[g][i]: (g, i) for g, rule in enumerate(self.rules)
                 for i in rule.candidates(self.local_point, self.limit)}

        def run(store: BlockStore) -> list[Any]:
            found = store.exists(candidates)  # a fault reads as all-absent: no hit
            avail = [list(row) for row in self.local]
            for k, present in zip(candidates, found, strict=True):
                if present:
                    g, i = where[k]
                    avail[g][i] = True
            p = hit_point(self.rules, avail, self.limit)
            if p <= self.local_point:
                return [None] * len(owned)
            need = {self.keys[g][i] for g, rule in enumerate(self.rules) for i in rule.needed(p)
                    if not self.local[g][i]}
            # Keys owned by an earlier request's read are landed by that read.
            want = [k for k in owned if k in need]
            got = dict(zip(want, store.get(want), strict=True))
            return [None if got.get(k) is None else (self.page_type[where[k][0]], where[k][0], got[k])
                    for k in owned]

        return run
