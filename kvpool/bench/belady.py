"""The offline-optimal reference for a trace: Belady's MIN eviction on the same pool and call pattern.

`BeladyBlockPool` knows the whole future: when a cached block must go, it evicts the free cached block
whose hash is next looked up farthest in the future (never again first). Ties go to the deeper block,
so a chain is never cut above a block that is kept: a child is never used before its parent. Replaying
a trace through it gives the hit rate an ideal eviction policy would reach with the same pool size.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence

from kvpool.bench.replay import replay
from kvpool.bench.workloads import TraceRequest
from kvpool.core.block import BlockHash, KVCacheBlock
from kvpool.core.block_pool import AllocationPlan, BlockPool
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.request import CacheRequest

NEVER = 1 << 60


class BeladyBlockPool(BlockPool):
    def __init__(self, num_blocks: int, uses: dict[BlockHash, list[int]],
                 depth: dict[BlockHash, int]) -> None:
        super().__init__(num_blocks)
        self.uses = uses  # hash -> sorted request indices whose lookup includes it
        self.depth = depth
        self.now = -1
        self._empty: list[KVCacheBlock] = [b for b in reversed(self.blocks) if not b.is_null]
        # Max-heap on next use: entries (-next_use, -depth, block_id, version).
        self._heap: list[tuple[int, int, int, int]] = []
        self._version = [0] * num_blocks
        self._num_free = len(self._empty)

    def _next_use(self, h: BlockHash) -> int:
        pos = self.uses.get(h)
        if not pos:
            return NEVER
        i = bisect_right(pos, self.now)
        return pos[i] if i < len(pos) else NEVER

    def get_num_free_blocks(self) -> int:
        return self._num_free

    def free_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks if b.ref_cnt == 0 and not b.is_null]

    def _pop_victim(self) -> KVCacheBlock:
        if self._empty:
            return self._empty.pop()
        heap = self._heap
        while True:
            neg_next, neg_depth, bid, ver = heapq.heappop(heap)
            blk = self.blocks[bid]
            if ver != self._version[bid] or blk.ref_cnt != 0:
                continue  # stale: taken by a hit since it was freed
            assert blk.block_hash is not None
            nxt = self._next_use(blk.block_hash)
            if nxt != -neg_next:
                # Its next use was a lookup that missed: it moved later. Re-rank it.
                heapq.heappush(heap, (-nxt, neg_depth, bid, ver))
                continue
            return blk

    def get_new_blocks(self, num_blocks: int, plan: AllocationPlan | None = None) -> list[KVCacheBlock]:
        if num_blocks > self._num_free:
            raise ValueError("not enough free blocks")
        out = []
        for _ in range(num_blocks):
            blk = self._pop_victim()
            if blk.block_hash is not None:
                self._uncache(blk)
            blk.ref_cnt = 1
            self._version[blk.block_id] += 1
            out.append(blk)
        self._num_free -= num_blocks
        return out

    def _take_free(self, blk: KVCacheBlock) -> None:
        self._num_free -= 1
        self._version[blk.block_id] += 1

    def _released(self, first: list[KVCacheBlock], last: list[KVCacheBlock],
                  low: Sequence[KVCacheBlock] = ()) -> None:
        for blk in (*first, *low, *last):
            self._num_free += 1
            self._version[blk.block_id] += 1
            h = blk.block_hash
            if h is None:
                self._empty.append(blk)
            else:
                heapq.heappush(self._heap, (-self._next_use(h), -self.depth.get(h, 0), blk.block_id,
                                            self._version[blk.block_id]))


def belady_hit_rate(trace: list[TraceRequest], num_blocks: int, block_size: int, concurrency: int,
                    hash_algo: str = "sha256") -> float:
    """Hit rate of the trace under Belady's MIN eviction, with kvpool's call pattern and pool size."""
    hasher = BlockHasher(block_size, hash_algo)
    uses: dict[BlockHash, list[int]] = {}
    depth: dict[BlockHash, int] = {}
    for i, tr in enumerate(trace):
        req = CacheRequest(tr["id"], tr["prompt"] + tr["decode"], hasher=hasher)
        n_lookup = (len(tr["prompt"]) - 1) // block_size
        for d, h in enumerate(req.block_hashes):
            depth[h] = d
            if d < n_lookup:
                uses.setdefault(h, []).append(i)
    pool = BeladyBlockPool(num_blocks, uses, depth)
    manager = KVCacheManager(num_blocks, block_size, block_pool=pool)

    def on_admit(i: int) -> None:
        pool.now = i

    return replay(trace, manager, hasher, concurrency, on_admit=on_admit).hit_rate
