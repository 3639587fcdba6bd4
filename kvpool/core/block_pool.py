"""Block pools: one tier's blocks, ref counts and prefix-cache map (hash -> block), behind one contract.

`BlockPool` is the contract every pool implements (device, host, each page size of a two-level pool)
and holds what they share: the blocks, the one implementation of ref counting (`touch`, `free_blocks`),
the hash map with duplicates, KV events and the integrity check. Which free block is reused next is
not the pool's business but its eviction policy's (`kvpool.core.eviction`); subclasses say only what
"taking a free block" and "releasing one" mean for their structures. `DeviceBlockPool` is the device
tier: its free blocks live in the policy (LRU by default, the seeds' order).

Room is checked before anything changes: `plan_allocation` answers whether an allocation fits and
returns the plan the allocation then follows (`AllocationPlan`), so a refused allocation changes
nothing and an accepted one never runs out midway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvpool.core.block import BlockHash, KVCacheBlock, group_key, raw_hash
from kvpool.core.events import MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.core.eviction import EvictionPolicy, make_policy
from kvpool.core.hashing import block_extra_keys
from kvpool.core.request import CacheRequest

EvictionListener = Callable[[KVCacheBlock, BlockHash], None]


class TierPool(Protocol):
    """What the manager asks of a tier's pool as a whole: `BlockPool` (one page size) and
    `TwoLevelBlockPool` (large pages split into pages of several sizes) both implement it."""

    num_blocks: int
    num_usable_blocks: int

    @property
    def usage(self) -> float: ...

    @property
    def blocks(self) -> list[KVCacheBlock]: ...

    def get_num_free_blocks(self) -> int: ...

    def plan_groups(self, need: Sequence[int], skipped: Sequence[Sequence[KVCacheBlock]],
                    hits: Sequence[Sequence[KVCacheBlock]]) -> AllocationPlan | None: ...

    def reset_prefix_cache(self) -> bool: ...

    def note_release(self, num_output_tokens: int | None) -> None: ...

    def take_events(self) -> list[KVCacheEvent]: ...

    def check_integrity(self) -> None: ...

    def free_block_ids(self) -> list: ...


class AllocationPlan:
    """What an accepted allocation may take. `spare`: whole free large pages beyond what a two-level
    pool's allocation needs (a type may open one rather than evict a more recent page of its own)."""

    __slots__ = ("spare",)

    def __init__(self, spare: int = 0) -> None:
        self.spare = spare


class BlockPool:
    """A tier's blocks, ref counts and prefix-cache map. Subclasses keep the free blocks (see module doc)."""

    medium = MEDIUM_DEVICE

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, enable_kv_events: bool = False,
                 reserve_null_block: bool = True) -> None:
        min_blocks = 2 if reserve_null_block else 1
        if num_blocks < min_blocks:
            raise ValueError(f"num_blocks: need at least {min_blocks}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # First block holding a hash: handed out on a hit. Later duplicates (same content in another
        # block, see the V1 prefix caching PR) wait in _dups and take over if the first is evicted.
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self._dups: dict[BlockHash, list[KVCacheBlock]] = {}
        # Blocks cached without a BlockStored (the host tier's copies landed from a KV store: their tokens are
        # not known here): their removal publishes nothing either, so a subscriber's count never goes below 0.
        self._unannounced: set[int] = set()
        self.events: list[KVCacheEvent] = []
        self.eviction_listeners: list[EvictionListener] = []
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            self.null_block = self.blocks[0]
            self.null_block.is_null = True
            self.null_block.ref_cnt = 1  # never free, never evicted
        self.num_usable_blocks = num_blocks - (1 if reserve_null_block else 0)

    # -- the contract: what each pool implements ---------------------------------------------------

    def get_num_free_blocks(self) -> int:
        raise NotImplementedError

    def get_new_blocks(self, num_blocks: int, plan: AllocationPlan | None = None) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (evicting what they cached), each with ref_cnt 1."""
        raise NotImplementedError

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (next evicted first)."""
        raise NotImplementedError

    def _take_free(self, blk: KVCacheBlock) -> None:
        """A free block (ref_cnt 0) is taken by a hit: out of the free structures."""
        raise NotImplementedError

    def _released(self, first: list[KVCacheBlock], last: list[KVCacheBlock],
                  low: Sequence[KVCacheBlock] = ()) -> None:
        """Blocks whose ref_cnt reached 0: `first` hold nothing and are reused before any cached block
        (in the given order), `last` keep their cached content and are evicted by the policy (first
        given first), `low` hold content no hit is likely to use: evicted after `first`, before `last`."""
        raise NotImplementedError

    def plan_groups(self, need: Sequence[int], skipped: Sequence[Sequence[KVCacheBlock]],
                    hits: Sequence[Sequence[KVCacheBlock]]) -> AllocationPlan | None:
        """Whether groups needing `need[g]` free blocks (new ones plus hits sitting free) fit once the
        skipped blocks this request alone holds are released: the plan to follow, or None. Changes
        nothing."""
        releasable = sum(1 for sk in skipped for b in sk if b.ref_cnt == 1 and not b.is_null)
        return _PLAN if sum(need) <= self.get_num_free_blocks() + releasable else None

    # -- ref counting: one implementation for every pool ---------------------------------------------

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A hit: ref_cnt += 1, taking free blocks out of the free structures."""
        for blk in blocks:
            if blk.is_null:
                continue
            if blk.ref_cnt == 0:
                self._take_free(blk)
            blk.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt -= 1; blocks reaching 0 become free in the given order (first evicted first): those
        holding no cached content as one batch at the front, the cached ones to the policy."""
        self._released(*self._drop_refs(ordered_blocks))

    def free_blocks_to_front(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Release blocks a later hit is unlikely to use (a sliding window's blocks outside every window
        that matters): evicted before any cached block a hit needs, first given first, but never ahead
        of empty blocks (evicting content while empty blocks wait would lose hits for nothing: a shared
        prefix may end at any block, not only where this request's likely hit points are)."""
        first, low = self._drop_refs(ordered_blocks)
        self._released(first, [], low)

    @staticmethod
    def _drop_refs(ordered_blocks: Iterable[KVCacheBlock]) -> tuple[list[KVCacheBlock], list[KVCacheBlock]]:
        """ref_cnt -= 1 on each block; those reaching 0, in the given order, split into the ones holding
        nothing and the ones holding cached content."""
        empty: list[KVCacheBlock] = []
        cached: list[KVCacheBlock] = []
        for blk in ordered_blocks:
            if blk.is_null:
                continue
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                (empty if blk.block_hash is None else cached).append(blk)
            elif blk.ref_cnt < 0:
                raise AssertionError(f"block {blk.block_id} freed more often than it was taken")
        return empty, cached

    # -- shared -------------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache_full_blocks(self, request: CacheRequest, blocks: Sequence[KVCacheBlock], num_cached: int,
                          num_full: int, block_size: int, group_id: int = 0) -> None:
        """Give blocks [num_cached, num_full) of a request their hashes and enter them in the map.

        With events on, one `BlockStored` per run of blocks newly cached here (vLLM's shape: for a request's
        new blocks, one for the call), duplicates of a hash already cached included: the run's hashes in
        chain order, its tokens, and the parent being the hash of the block before it. A block already
        cached (a device hit between swapped-in host hits) or a slot the layer type does not keep ends a
        run: an event's tokens are always exactly its blocks'.
        """
        if num_full <= num_cached:
            return
        hashes = request.block_hashes
        cached = self.cached
        events = self.enable_kv_events
        run = num_cached  # with events: where the current run of stored blocks starts
        observe = self._observe_cached
        for i in range(num_cached, num_full):
            blk = blocks[i]
            if blk.block_hash is not None or blk.is_null:
                # A prefix hit (already cached), or a slot this layer type does not keep.
                if events:
                    self._stored(request, blocks, run, i, block_size, group_id)
                    run = i + 1
                continue
            h = hashes[i] if group_id == 0 else group_key(hashes[i], group_id)
            blk.block_hash = h
            blk.group_id = group_id
            if h not in cached:
                cached[h] = blk
            else:
                self._dups.setdefault(h, []).append(blk)
            if observe is not None:
                parent = blocks[i - 1] if i else None
                observe(blk, i, None if parent is None or parent.is_null else parent)
            if events:
                blk.token_ids = request.all_token_ids[i * block_size:(i + 1) * block_size]
                blk.parent_hash = hashes[i - 1] if i else None
                blk.lora_id = request.lora_id
                blk.extra_keys = (block_extra_keys(request, i * block_size, (i + 1) * block_size) or None
                                  if request.has_extra_keys else None)
        if events:
            self._stored(request, blocks, run, num_full, block_size, group_id)

    def _stored(self, request: CacheRequest, blocks: Sequence[KVCacheBlock], lo: int, hi: int, block_size: int,
                group_id: int) -> None:
        """The `BlockStored` of a request's blocks [lo, hi), just cached (none if the run is empty)."""
        if hi <= lo:
            return
        hashes = request.block_hashes
        extra = [blocks[i].extra_keys for i in range(lo, hi)]
        self.events.append(BlockStored(
            block_hashes=list(hashes[lo:hi]), parent_block_hash=hashes[lo - 1] if lo else None,
            token_ids=request.all_token_ids[lo * block_size:hi * block_size], block_size=block_size,
            lora_id=request.lora_id, extra_keys=extra if any(e is not None for e in extra) else None,
            medium=self.medium, group_id=group_id))

    # The policy's `on_cached` when it observes (set by pools with a policy), else None.
    _observe_cached: Callable[[KVCacheBlock, int, KVCacheBlock | None], None] | None = None
    _observe_uncached: Callable[[KVCacheBlock], None] | None = None

    def _uncache(self, blk: KVCacheBlock) -> None:
        """Drop a block's hash from the map (it is being reused for new content). A duplicate copy
        takes over the map entry; every copy that goes is a `BlockRemoved`, as in vLLM."""
        h = blk.block_hash
        assert h is not None
        blk.block_hash = None
        if self.cached.get(h) is blk:
            dups = self._dups.get(h)
            if dups:
                self.cached[h] = dups.pop(0)
                if not dups:
                    del self._dups[h]
            else:
                del self.cached[h]
        else:
            dups = self._dups[h]
            dups.remove(blk)
            if not dups:
                del self._dups[h]
        if self.enable_kv_events:
            if self._unannounced and blk.block_id in self._unannounced:
                self._unannounced.discard(blk.block_id)
            else:
                self.events.append(BlockRemoved(block_hashes=[raw_hash(h, blk.group_id)], medium=self.medium,
                                                group_id=blk.group_id))
        if self._observe_uncached is not None:
            self._observe_uncached(blk)
        for listener in self.eviction_listeners:
            listener(blk, h)

    def note_release(self, num_output_tokens: int | None) -> None:
        """The blocks freed next come from a request that finished after generating `num_output_tokens`
        tokens (None: not known, or preempted). A pool whose eviction policy learns from traffic
        passes it on (`on_release`)."""

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        self.forget_cached()
        return True

    def forget_cached(self) -> None:
        """Drop every hash and map entry (the caller checked that no block is in use)."""
        for blk in self.blocks:
            if blk.block_hash is not None and self._observe_uncached is not None:
                self._observe_uncached(blk)
            blk.block_hash = None
        self.cached.clear()
        self._dups.clear()
        self._unannounced.clear()
        if self.enable_kv_events:
            self.events.append(AllBlocksCleared(medium=self.medium))

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def num_cached_blocks(self) -> int:
        return len(self.cached) + sum(len(d) for d in self._dups.values())

    def check_integrity(self) -> None:
        """Raise AssertionError if any block-level invariant is broken."""
        free_ids = self.free_block_ids()
        free_set = set(free_ids)
        assert len(free_ids) == len(free_set), f"a block is twice in the free queue: {free_ids}"
        assert len(free_ids) == self.get_num_free_blocks(), "free count disagrees with the free queue"
        in_use = [b for b in self.blocks if b.ref_cnt > 0 and not b.is_null]
        assert len(free_ids) + len(in_use) == self.num_usable_blocks, (
            f"free {len(free_ids)} + in use {len(in_use)} != {self.num_usable_blocks}")
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref_cnt {b.ref_cnt}"
            if b.is_null:
                assert b.block_id not in free_set, "the null block is in the free queue"
                assert b.block_hash is None, "the null block holds a hash"
            elif b.ref_cnt == 0:
                assert b.block_id in free_set, f"block {b.block_id} has ref_cnt 0 but is not free"
            else:
                assert b.block_id not in free_set, f"block {b.block_id} is free and in use"
        self.check_map()

    def check_map(self) -> None:
        """Every map entry points at a block carrying its hash, and every carried hash is mapped."""
        holders: dict[BlockHash, list[KVCacheBlock]] = {}
        for b in self.blocks:
            if b.block_hash is not None:
                holders.setdefault(b.block_hash, []).append(b)
        for h, blk in self.cached.items():
            assert blk.block_hash == h, f"map entry points at block {blk.block_id} that does not carry it"
        for h, dups in self._dups.items():
            assert h in self.cached and dups, "a duplicate list without a primary entry"
            for blk in dups:
                assert blk.block_hash == h and blk is not self.cached[h]
        for h, bs in holders.items():
            mapped = [self.cached.get(h), *self._dups.get(h, [])]
            assert sorted(b.block_id for b in bs) == sorted(b.block_id for b in mapped if b), (
                f"blocks carrying a hash and the map disagree: {bs} vs {mapped}")
        if not self.enable_caching:
            assert not self.cached, "prefix caching is off but blocks are cached"


_PLAN = AllocationPlan()  # the plan of pools with one page size: nothing to carry


class DeviceBlockPool(BlockPool):
    """The device tier: free blocks in an eviction policy (LRU unless told otherwise)."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, enable_kv_events: bool = False,
                 reserve_null_block: bool = True, eviction_policy: str | EvictionPolicy | None = None) -> None:
        super().__init__(num_blocks, enable_caching=enable_caching, enable_kv_events=enable_kv_events,
                         reserve_null_block=reserve_null_block)
        self.policy: EvictionPolicy = make_policy(eviction_policy)
        if self.policy.num_free_blocks:
            raise ValueError("eviction_policy: give the pool a fresh policy (this one already holds blocks)")
        # In block-id order: the first allocations take the lowest ids (the seeds' examples rely on it).
        self.policy.prepend_n([b for b in self.blocks if not b.is_null])
        # The hot paths call the policy's observation hooks only when it has any (LRU has none).
        self._observes = self.policy.observes
        if self._observes:
            self._observe_cached = self.policy.on_cached
            self._observe_uncached = self.policy.on_uncached

    @property
    def free_block_queue(self) -> EvictionPolicy:
        """The free blocks (the policy holds them); kept under the seeds' name for tests and tools."""
        return self.policy

    def get_num_free_blocks(self) -> int:
        return self.policy.num_free_blocks

    def free_block_ids(self) -> list[int]:
        return [b.block_id for b in self.policy]

    def get_new_blocks(self, num_blocks: int, plan: AllocationPlan | None = None) -> list[KVCacheBlock]:
        if num_blocks == 0:
            return []
        blocks = self.policy.popleft_n(num_blocks)
        for blk in blocks:
            if blk.block_hash is not None:
                self._uncache(blk)
            blk.ref_cnt = 1
        return blocks

    def _take_free(self, blk: KVCacheBlock) -> None:
        self.policy.remove(blk)

    def note_release(self, num_output_tokens: int | None) -> None:
        if self._observes:
            self.policy.on_release(num_output_tokens)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        if self._observes:
            blocks = list(blocks)
            self.policy.on_touch(blocks)
        super().touch(blocks)

    def check_integrity(self) -> None:
        super().check_integrity()
        check = getattr(self.policy, "check", None)  # a policy's own invariants, where it has any
        if check is not None:
            check()

    def _released(self, first: list[KVCacheBlock], last: list[KVCacheBlock],
                  low: Sequence[KVCacheBlock] = ()) -> None:
        if first:
            self.policy.prepend_n(first)
        if low:
            self.policy.append_low_n(low)
        if last:
            self.policy.append_n(last)
