"""The host tier: host-memory pools behind the device pool, for every layer group, and the swap plan.

`HostTier` owns what offloading needs beside the pools themselves: it listens to device evictions and
shelters each evicted cached block (a device -> host copy in the swap plan), answers lookups that
continue past the device tier, turns a host hit into a host -> device copy, pins the host blocks
taking part in a step's copies until the plan is handed to the runner, and (write-through mode)
copies newly cached blocks once the forward that computes them has run.

Every layer group goes through it. Blocks of all groups share the host pool of their page size, keyed
like the device map (`group_key`: the group is part of the key), so a sliding-window group shelters
the window blocks a hit needs and a state group its boundary states, exactly what the device tier
cached. A device pool with one page size has one host pool and plans copies as (src, dst) pairs; a
two-level device pool (pages of several sizes) has one host pool per page size, its capacity split
evenly in bytes, and plans copies as (page type, src, dst) triples.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from kvpool.core.block import BlockHash, KVCacheBlock
from kvpool.core.block_pool import BlockPool
from kvpool.core.events import KVCacheEvent, block_stored
from kvpool.core.host_pool import HostBlockPool
from kvpool.core.swap import SwapPlan


def split_host_pages(num_large_pages: int, per_large: Sequence[int]) -> list[int]:
    """Host pages per page type for `num_large_pages` large pages' worth of host memory, split evenly
    in bytes between the types (a large page holds per_large[t] pages of type t)."""
    n = len(per_large)
    return [num_large_pages * p // n for p in per_large]


class HostTier:
    def __init__(self, device_pools: Sequence[BlockPool], num_blocks: Sequence[int], *, typed: bool = False,
                 eviction: str = "lru", enable_kv_events: bool = False, write_through: bool = False,
                 block_size: int = 0) -> None:
        """`device_pools`: one per page type (one, unless the device pool is two-level); `num_blocks`:
        host blocks of each type (`split_host_pages`). `typed`: plan copies as triples."""
        if len(num_blocks) != len(device_pools) or min(num_blocks) < 1:
            raise ValueError(f"num_host_blocks: need at least 1 host block per page type, got {list(num_blocks)}")
        self.typed = typed
        self.write_through = write_through
        self.block_size = block_size
        self.enable_kv_events = enable_kv_events
        self.pools = [HostBlockPool(n, eviction=eviction, enable_kv_events=enable_kv_events) for n in num_blocks]
        for p in self.pools:
            for b in p.blocks:
                b.on_host = True
        self.device_pools = list(device_pools)
        for t, dp in enumerate(self.device_pools):
            dp.eviction_listeners.append(partial(self._shelter, t))
        self._plan = SwapPlan()
        # Host blocks taking part in this step's copies, unpinned once the plan is handed out; and
        # write-through copies, which can only run once this step's forward has computed them.
        self._pinned: list[tuple[int, KVCacheBlock]] = []  # (page type, host block)
        self._next_out: list[tuple[int, int, int]] = []
        self._next_pinned: list[tuple[int, KVCacheBlock]] = []
        self._events: list[KVCacheEvent] = []

    # -- lookups and hits ------------------------------------------------------------------------------

    def get(self, page_type: int, key: BlockHash) -> KVCacheBlock | None:
        return self.pools[page_type].cached.get(key)

    def pin(self, page_type: int, blocks: Sequence[KVCacheBlock]) -> None:
        """Pin host hits before any device allocation of the step can evict into the host tier."""
        self.pools[page_type].touch(blocks)
        self._pinned.extend((page_type, b) for b in blocks)

    def swap_in(self, page_type: int, host_block: KVCacheBlock, device_block: KVCacheBlock) -> None:
        """Copy a pinned host hit into a device block (before this step's forward)."""
        self._add(self._plan.swap_in, self._plan.typed_in, page_type, host_block.block_id, device_block.block_id)

    def _add(self, pairs: list[tuple[int, int]], triples: list[tuple[int, int, int]], page_type: int,
             src: int, dst: int) -> None:
        if self.typed:
            triples.append((page_type, src, dst))
        else:
            pairs.append((src, dst))

    # -- sheltering ------------------------------------------------------------------------------------

    def _shelter(self, page_type: int, block: KVCacheBlock, key: BlockHash) -> None:
        """Device eviction listener: copy the evicted block's content to the host tier."""
        if self.device_pools[page_type].cached.get(key) is not None:
            # A duplicate copy on the device took over the hash: lookups still hit there, and a host
            # copy would only take a host block (it is sheltered when that copy goes in turn).
            return
        hb = self.pools[page_type].shelter(key, block.group_id)
        if hb is None:
            return
        self._add(self._plan.swap_out, self._plan.typed_out, page_type, block.block_id, hb.block_id)
        self._pinned.append((page_type, hb))
        self._stored(hb, block, key)  # (the device block has already given up its hash)

    def write_through_blocks(self, page_type: int, blocks: Sequence[KVCacheBlock]) -> None:
        """Eager mode: copy newly cached device blocks here once computed (in the next plan)."""
        pool = self.pools[page_type]
        for blk in blocks:
            if blk.block_hash is None or blk.is_null:
                continue
            hb = pool.shelter(blk.block_hash, blk.group_id)
            if hb is not None:
                self._next_out.append((page_type, blk.block_id, hb.block_id))
                self._next_pinned.append((page_type, hb))
                self._stored(hb, blk, blk.block_hash)

    def _stored(self, host_block: KVCacheBlock, device_block: KVCacheBlock, key: BlockHash) -> None:
        """A `BlockStored` for the host copy of `device_block`, whose key is `key`."""
        if self.enable_kv_events:
            d = device_block
            host_block.token_ids, host_block.parent_hash = d.token_ids, d.parent_hash
            host_block.lora_id, host_block.extra_keys = d.lora_id, d.extra_keys
            self._events.append(block_stored(d, key, self.block_size, self.pools[0].medium))

    # -- the step --------------------------------------------------------------------------------------

    def end_step(self) -> SwapPlan:
        """The plan for the step about to run; unpins the host blocks it used (no allocation happens
        between now and the copies)."""
        plan = self._plan
        if len(self.pools) == 1:
            self.pools[0].free_blocks([b for _, b in self._pinned])
        else:
            for t, p in enumerate(self.pools):
                p.free_blocks([b for bt, b in self._pinned if bt == t])
        self._pinned, self._next_pinned = self._next_pinned, []
        self._plan = SwapPlan()
        for t, src, dst in self._next_out:
            self._add(self._plan.swap_out, self._plan.typed_out, t, src, dst)
        self._next_out = []
        return plan

    @property
    def busy(self) -> bool:
        """Copies are planned or pinned (a reset must wait)."""
        return bool(self._pinned or self._next_pinned)

    def reset(self) -> bool:
        if self.busy:
            return False
        return all([p.reset_prefix_cache() for p in self.pools])

    # -- observability -----------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def usage(self) -> float:
        return sum(p.num_cached_blocks() for p in self.pools) / self.num_blocks

    @property
    def cached(self) -> dict[BlockHash, KVCacheBlock]:
        """The first (or only) page type's map: single-pool models, tests and tools."""
        return self.pools[0].cached

    @property
    def blocks(self) -> list[KVCacheBlock]:
        return self.pools[0].blocks

    def free_block_ids(self) -> list[int]:
        return self.pools[0].free_block_ids()

    def take_events(self) -> list[KVCacheEvent]:
        # Host BlockStored events are built here (with the device block's tokens); removals come from
        # the pools. Order: what was stored, then what was evicted since the last call.
        events, self._events = self._events, []
        for p in self.pools:
            events += p.take_events()
        return events

    def check_integrity(self) -> None:
        pins: dict[int, int] = {}
        for _, b in self._pinned + self._next_pinned:
            pins[id(b)] = pins.get(id(b), 0) + 1
        for p in self.pools:
            p.check_integrity()
            for b in p.blocks:
                assert b.ref_cnt == pins.get(id(b), 0), f"host block {b.block_id}: pins disagree"
