"""The host tier: a pool of host-memory blocks that shelters cached blocks evicted from the device.

Host blocks are never in a request's block table: they hold copies. A device block evicted while it
holds a hash is copied here (a swap-out) instead of being lost; a later prefix hit here is a copy back
(a swap-in) instead of a recompute. The tier keeps its own hash map (the shared `BlockPool` one) and
its own eviction policy: LRU, or ARC (adaptive replacement: recency and frequency lists with ghost
lists steering the split), chosen with `eviction`. Blocks taking part in the current step's copies are
pinned (ref_cnt > 0) so that no eviction of the same step reuses them before the copy has run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvpool.core.block import BlockHash, KVCacheBlock
from kvpool.core.block_pool import BlockPool
from kvpool.core.events import BlockStored
from kvpool.core.free_queue import FreeBlockQueue

HOST_EVICTION_POLICIES = ("lru", "arc")


class HostBlockPool(BlockPool):
    medium = "host"

    def __init__(self, num_blocks: int, *, eviction: str = "lru", enable_kv_events: bool = False) -> None:
        if eviction not in HOST_EVICTION_POLICIES:
            raise ValueError(f"host_eviction: {eviction!r} is not one of {HOST_EVICTION_POLICIES}")
        super().__init__(num_blocks, enable_kv_events=enable_kv_events, reserve_null_block=False)
        self.eviction = eviction
        # Unpinned blocks: empty ones first, then cached ones in eviction order (LRU). With ARC the
        # cached ones live in t1/t2 instead and this queue holds only the empty ones.
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.t1: OrderedDict[BlockHash, KVCacheBlock] = OrderedDict()  # ARC: seen once, LRU first
        self.t2: OrderedDict[BlockHash, KVCacheBlock] = OrderedDict()  # ARC: seen again
        self.b1: OrderedDict[BlockHash, None] = OrderedDict()  # ARC ghosts evicted from t1
        self.b2: OrderedDict[BlockHash, None] = OrderedDict()  # ARC ghosts evicted from t2
        self.p = 0  # ARC: target size of t1
        # ARC: hashes whose next attach lands in t2 (a hit while pinned, or re-sheltered from a ghost list).
        self._seen_again: set[BlockHash] = set()
        self._pinned = 0

    # -- the tier interface -------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks a shelter could take now: every unpinned block (cached content is evictable)."""
        return self.num_blocks - self._pinned

    @property
    def usage(self) -> float:
        """Fraction of host blocks holding cached content."""
        return self.num_cached_blocks() / self.num_blocks

    def free_block_ids(self) -> list[int]:
        ids = self.free_block_queue.block_ids()
        if self.eviction == "arc":
            ids += [b.block_id for b in (*self.t1.values(), *self.t2.values()) if b.ref_cnt == 0]
        return ids

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Empty host blocks, evicting cached ones by the policy; returned pinned (ref_cnt 1)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"host tier: asked for {num_blocks} blocks, {self.get_num_free_blocks()} unpinned")
        out = []
        for _ in range(num_blocks):
            blk = self._victim()
            if blk.block_hash is not None:
                self._uncache(blk)
            blk.ref_cnt = 1
            self._pinned += 1
            out.append(blk)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Pin blocks (the source of a swap-in this step) and count the access for the policy."""
        for blk in blocks:
            if blk.ref_cnt == 0:
                self._detach(blk)
                self._pinned += 1
            blk.ref_cnt += 1
            if self.eviction == "arc" and blk.block_hash is not None:
                self._seen_again.add(blk.block_hash)  # a hit: frequently used from now on

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Unpin: the block becomes evictable again, most recently used."""
        for blk in ordered_blocks:
            blk.ref_cnt -= 1
            if blk.ref_cnt < 0:
                raise AssertionError(f"host block {blk.block_id} unpinned more often than pinned")
            if blk.ref_cnt == 0:
                self._pinned -= 1
                self._attach(blk)

    # -- sheltering ---------------------------------------------------------------------------------

    def shelter(self, block_hash: BlockHash, token_ids: list[int] | None = None, block_size: int = 0
                ) -> KVCacheBlock | None:
        """Make room for a copy of a block holding `block_hash`; None if the tier already holds it
        or every host block is pinned. The returned block is pinned until the step's copies run."""
        have = self.cached.get(block_hash)
        if have is not None:
            # Already here (written through, or sheltered and swapped back in): refresh it.
            if have.ref_cnt == 0:
                self._detach(have)
                self._attach(have, hit=True)
            return None
        if self.get_num_free_blocks() == 0:
            return None
        if self.eviction == "arc":
            self._arc_adapt(block_hash)
        (blk,) = self.get_new_blocks(1)
        blk.block_hash = block_hash
        self.cached[block_hash] = blk
        if self.enable_kv_events:
            self.events.append(BlockStored(block_hashes=[block_hash], parent_block_hash=None,
                                           token_ids=token_ids or [], block_size=block_size, medium=self.medium))
        return blk

    # -- policy internals ---------------------------------------------------------------------------

    def _detach(self, blk: KVCacheBlock) -> None:
        """Take an unpinned block out of the policy's structures."""
        h = blk.block_hash
        if self.eviction == "arc" and h is not None:
            if self.t1.pop(h, None) is None:
                self.t2.pop(h)
        else:
            self.free_block_queue.remove(blk)

    def _attach(self, blk: KVCacheBlock, hit: bool = False) -> None:
        h = blk.block_hash
        if h is None:
            self.free_block_queue.appendleft(blk)  # empty: reused before anything cached
        elif self.eviction == "arc":
            # A block seen for the first time enters t1; anything seen again goes to t2.
            (self.t2 if hit or h in self._seen_again else self.t1)[h] = blk
            self._seen_again.discard(h)
        else:
            self.free_block_queue.append(blk)

    def _victim(self) -> KVCacheBlock:
        q = self.free_block_queue
        if self.eviction == "lru" or q.num_free_blocks:
            return q.popleft()
        # ARC replace: evict from t1 while it exceeds its target p, else from t2.
        from_t1 = bool(self.t1) and (len(self.t1) > self.p or not self.t2)
        src, ghosts = (self.t1, self.b1) if from_t1 else (self.t2, self.b2)
        h, blk = src.popitem(last=False)
        ghosts[h] = None
        while len(self.b1) + len(self.b2) > self.num_blocks:
            (self.b1 if len(self.b1) > len(self.b2) else self.b2).popitem(last=False)
        return blk

    def _arc_adapt(self, block_hash: BlockHash) -> None:
        """A miss: a hash remembered in a ghost list moves the t1/t2 split, and enters t2."""
        c = self.num_blocks
        if block_hash in self.b1:
            self.p = min(c, self.p + max(1, len(self.b2) // max(1, len(self.b1))))
            del self.b1[block_hash]
            self._seen_again.add(block_hash)
        elif block_hash in self.b2:
            self.p = max(0, self.p - max(1, len(self.b1) // max(1, len(self.b2))))
            del self.b2[block_hash]
            self._seen_again.add(block_hash)

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        for od in (self.t1, self.t2):
            for blk in od.values():
                self.free_block_queue.append(blk)
            od.clear()
        self.b1.clear()
        self.b2.clear()
        self._seen_again.clear()
        self.p = 0
        return True

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self._pinned == sum(1 for b in self.blocks if b.ref_cnt > 0), "pinned count drifted"
        if self.eviction == "arc":
            for od in (self.t1, self.t2):
                for h, b in od.items():
                    assert b.block_hash == h and b.ref_cnt == 0
            assert not (set(self.t1) & set(self.t2)), "a hash in both t1 and t2"
