"""Block pools: one tier's blocks, its free queue and its prefix-cache map (hash -> block).

`BlockPool` is the interface of a tier and holds what every tier shares: the blocks, ref counting,
the hash map with duplicates, KV events and the integrity check. `DeviceBlockPool` is the device tier:
LRU eviction through the intrusive free queue. The host tier (offload) implements the same interface.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvpool.core.block import BlockHash, KVCacheBlock, group_key, raw_hash
from kvpool.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.core.free_queue import FreeBlockQueue
from kvpool.core.hashing import block_extra_keys
from kvpool.core.request import CacheRequest

EvictionListener = Callable[[KVCacheBlock, BlockHash], None]


class BlockPool:
    """A tier's blocks and prefix-cache map. Subclasses choose the free order (eviction policy)."""

    medium = "device"

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
        self.events: list[KVCacheEvent] = []
        self.eviction_listeners: list[EvictionListener] = []
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            self.null_block = self.blocks[0]
            self.null_block.is_null = True
            self.null_block.ref_cnt = 1  # never free, never evicted
        self.num_usable_blocks = num_blocks - (1 if reserve_null_block else 0)

    # -- the tier interface -------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        raise NotImplementedError

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (evicting what they cached), each with ref_cnt 1."""
        raise NotImplementedError

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A hit: ref_cnt += 1, taking free blocks out of the free queue."""
        raise NotImplementedError

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt -= 1; blocks reaching 0 become free, in the given order (first evicted first)."""
        raise NotImplementedError

    def free_blocks_to_front(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Release blocks a later hit is unlikely to use, ahead of the request's others: with no cached
        content they go to the front (reused first); with cached content, to the LRU tail in the given
        order. Never ahead of never-used or empty blocks: evicting cached content while empty blocks
        wait would lose hits for nothing (a shared prefix may end at any block, not only where this
        request's likely hit points are)."""
        raise NotImplementedError

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (next evicted first)."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache_full_blocks(self, request: CacheRequest, blocks: Sequence[KVCacheBlock], num_cached: int,
                          num_full: int, block_size: int, group_id: int = 0) -> None:
        """Give blocks [num_cached, num_full) of a request their hashes and enter them in the map."""
        hashes = request.block_hashes
        cached = self.cached
        events = self.events if self.enable_kv_events else None
        for i in range(num_cached, num_full):
            blk = blocks[i]
            if blk.block_hash is not None or blk.is_null:
                continue  # a prefix hit: already cached
            h = hashes[i] if group_id == 0 else group_key(hashes[i], group_id)
            blk.block_hash = h
            blk.group_id = group_id
            if h not in cached:
                cached[h] = blk
                if events is not None:
                    events.append(BlockStored(
                        block_hashes=[hashes[i]], parent_block_hash=hashes[i - 1] if i else None,
                        token_ids=request.all_token_ids[i * block_size:(i + 1) * block_size],
                        block_size=block_size, lora_id=request.lora_id,
                        extra_keys=block_extra_keys(request, i * block_size, (i + 1) * block_size)
                        if request.has_extra_keys else (),
                        medium=self.medium, group_id=group_id))
            else:
                self._dups.setdefault(h, []).append(blk)

    def _uncache(self, blk: KVCacheBlock) -> None:
        """Drop a block's hash from the map (it is being reused for new content)."""
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
                if self.enable_kv_events:
                    self.events.append(BlockRemoved(block_hashes=[raw_hash(h, blk.group_id)], medium=self.medium,
                                                    group_id=blk.group_id))
        else:
            dups = self._dups[h]
            dups.remove(blk)
            if not dups:
                del self._dups[h]
        for listener in self.eviction_listeners:
            listener(blk, h)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        self.forget_cached()
        return True

    def forget_cached(self) -> None:
        """Drop every hash and map entry (the caller checked that no block is in use)."""
        for blk in self.blocks:
            blk.block_hash = None
        self.cached.clear()
        self._dups.clear()
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


class DeviceBlockPool(BlockPool):
    """The device tier: LRU over cached free blocks, uncached free blocks reused first."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, enable_kv_events: bool = False,
                 reserve_null_block: bool = True) -> None:
        super().__init__(num_blocks, enable_caching=enable_caching, enable_kv_events=enable_kv_events,
                         reserve_null_block=reserve_null_block)
        self.free_block_queue = FreeBlockQueue(b for b in self.blocks if not b.is_null)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def free_block_ids(self) -> list[int]:
        return self.free_block_queue.block_ids()

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks == 0:
            return []
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for blk in blocks:
            if blk.block_hash is not None:
                self._uncache(blk)
            blk.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        remove = self.free_block_queue.remove
        for blk in blocks:
            if blk.ref_cnt == 0:
                remove(blk)
                blk.ref_cnt = 1
            elif not blk.is_null:
                blk.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        q = self.free_block_queue
        for blk in ordered_blocks:
            if blk.is_null:
                continue
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if blk.block_hash is not None:
                    q.append(blk)
                else:
                    q.appendleft(blk)
            elif blk.ref_cnt < 0:
                raise AssertionError(f"block {blk.block_id} freed more often than it was taken")

    def free_blocks_to_front(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        cached = [b for b in ordered_blocks if b.block_hash is not None]
        empty = [b for b in ordered_blocks if b.block_hash is None]
        self.free_blocks(cached)  # to the tail, in order
        self.free_blocks(reversed(empty))  # each to the front: reversed, so the first given is first
