"""The host tier's pool: host-memory blocks that shelter cached blocks evicted from the device.

Host blocks are never in a request's block table: they hold copies. A device block evicted while it
holds a hash is copied here (a swap-out) instead of being lost; a later prefix hit here is a copy back
(a swap-in) instead of a recompute. The pool keeps its own hash map (the shared `BlockPool` one) and
its own eviction policy (`kvpool.core.eviction`): LRU, or `ARCPolicy` (adaptive replacement: recency
and frequency lists with ghost lists steering the split). Blocks taking part in the current step's
copies are pinned (ref_cnt > 0) so that no eviction of the same step reuses them before the copy has
run. What the tier does with the pool (swap plans, pins, the eviction listener) is `kvpool.core.host_tier`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvpool.core.block import BlockHash, KVCacheBlock
from kvpool.core.block_pool import AllocationPlan, BlockPool
from kvpool.core.events import MEDIUM_HOST
from kvpool.core.eviction import EvictionPolicy, NoObservations, make_policy, policy_names
from kvpool.core.free_queue import FreeBlockQueue


class ARCPolicy(NoObservations):
    """Adaptive replacement (Megiddo and Modha): t1 holds hashes seen once, t2 hashes seen again, b1/b2
    remember what each evicted; a miss found in a ghost list moves the target size p of t1 toward the
    list that would have kept it. Empty blocks wait in their own queue and are reused first."""

    name = "arc"
    observes = True

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.empty = FreeBlockQueue()
        self.t1: OrderedDict[BlockHash, KVCacheBlock] = OrderedDict()  # seen once, LRU first
        self.t2: OrderedDict[BlockHash, KVCacheBlock] = OrderedDict()  # seen again
        self.b1: OrderedDict[BlockHash, None] = OrderedDict()  # ghosts evicted from t1
        self.b2: OrderedDict[BlockHash, None] = OrderedDict()  # ghosts evicted from t2
        self.p = 0
        # Hashes whose next release lands in t2 (a hit while pinned, or re-admitted from a ghost list).
        self._seen_again: set[BlockHash] = set()

    @property
    def num_free_blocks(self) -> int:
        return self.empty.num_free_blocks + len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self.empty
        yield from self.t1.values()
        yield from self.t2.values()

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self._victim() for _ in range(n)]

    def _victim(self) -> KVCacheBlock:
        if self.empty.num_free_blocks:
            return self.empty.popleft()
        # ARC replace: evict from t1 while it exceeds its target p, else from t2.
        from_t1 = bool(self.t1) and (len(self.t1) > self.p or not self.t2)
        src, ghosts = (self.t1, self.b1) if from_t1 else (self.t2, self.b2)
        h, blk = src.popitem(last=False)
        ghosts[h] = None
        while len(self.b1) + len(self.b2) > self.capacity:
            (self.b1 if len(self.b1) > len(self.b2) else self.b2).popitem(last=False)
        return blk

    def remove(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is None:
            self.empty.remove(block)
        elif self.t1.pop(h, None) is None:
            del self.t2[h]

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        for blk in blocks:
            h = blk.block_hash
            assert h is not None
            (self.t2 if h in self._seen_again else self.t1)[h] = blk
            self._seen_again.discard(h)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.empty.prepend_n(blocks)

    def append_low_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.append_n(blocks)

    def on_touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for blk in blocks:
            if blk.block_hash is not None:
                self._seen_again.add(blk.block_hash)  # a hit: frequently used from now on

    def on_miss(self, block_hash: BlockHash) -> None:
        """A hash about to be admitted: remembered in a ghost list, it moves p and enters t2."""
        if block_hash in self.b1:
            self.p = min(self.capacity, self.p + max(1, len(self.b2) // max(1, len(self.b1))))
            del self.b1[block_hash]
            self._seen_again.add(block_hash)
        elif block_hash in self.b2:
            self.p = max(0, self.p - max(1, len(self.b1) // max(1, len(self.b2))))
            del self.b2[block_hash]
            self._seen_again.add(block_hash)

    def reset(self) -> None:
        """Forget the history (the cache was reset); the caller re-queues the blocks as empty."""
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self._seen_again.clear()
        self.p = 0

    def check(self) -> None:
        for od in (self.t1, self.t2):
            for h, b in od.items():
                assert b.block_hash == h and b.ref_cnt == 0
        assert not (set(self.t1) & set(self.t2)), "a hash in both t1 and t2"


HOST_EVICTION_POLICIES = ("lru", "arc")  # the built-in ones; every registered device policy works too


def host_policy_names() -> list[str]:
    return sorted({"arc", *policy_names()})


def make_host_policy(name: str, capacity: int) -> EvictionPolicy:
    """A host tier's policy: ARC (host only: it keys on hashes), or any registered policy by name."""
    if name == "arc":
        return ARCPolicy(capacity)  # type: ignore[return-value]
    if name not in policy_names():
        raise ValueError(f"host_eviction: {name!r} is not one of {host_policy_names()}")
    return make_policy(name, field="host_eviction")


class HostBlockPool(BlockPool):
    medium = MEDIUM_HOST

    def __init__(self, num_blocks: int, *, eviction: str = "lru", enable_kv_events: bool = False) -> None:
        if eviction not in host_policy_names():
            raise ValueError(f"host_eviction: {eviction!r} is not one of {host_policy_names()}")
        super().__init__(num_blocks, enable_kv_events=enable_kv_events, reserve_null_block=False)
        self.eviction = eviction
        self._new_policy()
        self._pinned = 0

    def _new_policy(self) -> None:
        # Unpinned blocks: empty ones first, then cached ones in the policy's eviction order.
        self.policy = make_host_policy(self.eviction, self.num_blocks)
        self.policy.prepend_n(self.blocks)
        # A policy that learns is told when a block loses its hash (`shelter` tells it of new ones).
        self._observe_uncached = self.policy.on_uncached if self.policy.observes else None

    # -- the contract -------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks a shelter could take now: every unpinned block (cached content is evictable)."""
        return self.num_blocks - self._pinned

    @property
    def usage(self) -> float:
        """Fraction of host blocks holding cached content."""
        return self.num_cached_blocks() / self.num_blocks

    def free_block_ids(self) -> list[int]:
        return [b.block_id for b in self.policy]

    def get_new_blocks(self, num_blocks: int, plan: AllocationPlan | None = None) -> list[KVCacheBlock]:
        """Empty host blocks, evicting cached ones by the policy; returned pinned (ref_cnt 1)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"host tier: asked for {num_blocks} blocks, {self.get_num_free_blocks()} unpinned")
        out = self.policy.popleft_n(num_blocks)
        for blk in out:
            if blk.block_hash is not None:
                self._uncache(blk)
            blk.ref_cnt = 1
        self._pinned += num_blocks
        return out

    def _take_free(self, blk: KVCacheBlock) -> None:
        self.policy.remove(blk)
        self._pinned += 1

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:  # type: ignore[override]
        """Pin blocks (the source of a swap-in this step) and count the access for the policy."""
        if self.policy.observes:
            self.policy.on_touch(blocks)
        super().touch(blocks)

    def _released(self, first: list[KVCacheBlock], last: list[KVCacheBlock],
                  low: Sequence[KVCacheBlock] = ()) -> None:
        """Unpinned: evictable again, the cached ones most recently used."""
        last = [*low, *last]
        self._pinned -= len(first) + len(last)
        if first:
            self.policy.prepend_n(first)
        if last:
            self.policy.append_n(last)

    # -- sheltering ---------------------------------------------------------------------------------

    def shelter(self, block_hash: BlockHash, group_id: int = 0, announced: bool = True) -> KVCacheBlock | None:
        """Make room for a copy of a block holding `block_hash` (a key of layer group `group_id`: its
        removal events name the group and the raw hash, as the device pool's do); None if the tier
        already holds it or every host block is pinned. The returned block is pinned until the step's
        copies run. `announced=False`: no BlockStored is published for it (a copy landed from a KV store),
        so neither is its removal."""
        have = self.cached.get(block_hash)
        if have is not None:
            # Already here (written through, or sheltered and swapped back in): refresh it.
            if have.ref_cnt == 0:
                self.policy.remove(have)
                if self.policy.observes:
                    self.policy.on_touch([have])
                self.policy.append_n([have])
            return None
        if self.get_num_free_blocks() == 0:
            return None
        on_miss = getattr(self.policy, "on_miss", None)
        if on_miss is not None:
            on_miss(block_hash)
        (blk,) = self.get_new_blocks(1)
        blk.block_hash = block_hash
        blk.group_id = group_id
        self.cached[block_hash] = blk
        if not announced and self.enable_kv_events:
            self._unannounced.add(blk.block_id)
        if self.policy.observes:
            self.policy.on_cached(blk, 0, None)  # the host tier keeps no chain: no depth, no parent
        return blk

    def unshelter(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Blocks `shelter` gave whose copy could not be written: forget their hashes (they hold nothing
        that key names) and free them, empty."""
        for blk in blocks:
            if blk.block_hash is not None:
                self._uncache(blk)
        self.free_blocks(blocks)

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        # Every block is unpinned and now empty: rebuild the policy's structures in id order.
        self._new_policy()
        return True

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self._pinned == sum(1 for b in self.blocks if b.ref_cnt > 0), "pinned count drifted"
        check = getattr(self.policy, "check", None)
        if check is not None:
            check()
