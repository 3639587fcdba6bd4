"""The offline-optimal reference for a trace: Belady's MIN eviction on the same pool and call pattern.

`BeladyBlockPool` knows the whole future: when a cached block must go, it evicts the free cached block
whose hash is next looked up farthest in the future (never again first). Ties go to the deeper block,
so a chain is never cut above a block that is kept: a child is never used before its parent. Replaying
a trace through it gives the hit rate an ideal eviction policy would reach with the same pool size.

A free block's rank is its next use as of when it was freed. As the replay moves past that use (the
lookup reached another copy, or stopped short of it), the rank is stale and too low: every free block
whose rank has passed is ranked again when the replay moves on, so none hides under blocks needed
sooner. A second copy of a hash (two requests in flight computed the same block) is never looked up:
lookups find the map's copy, so it ranks as never used again.

It is the optimum (tested against exhaustive search on small traces) when the trace fits the pool as the
replay runs it. When the replay must wait, preempt or skip, what is cached decides when requests are
admitted too, and MIN is then a strong heuristic, not a bound: a policy may come out a little above it.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Collection, Sequence

from kvpool.bench.replay import ReplayResult, replay
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
        # Free blocks by the rank they were pushed with: (block id, version), ranked again once passed.
        self._by_rank: dict[int, list[tuple[int, int]]] = {}
        self._ranked_up_to = -1

    def advance(self, now: int) -> None:
        """The replay is at request `now`: rank again every free block whose next use has come."""
        self.now = now
        for k in range(self._ranked_up_to + 1, now + 1):
            for bid, ver in self._by_rank.pop(k, ()):
                blk = self.blocks[bid]
                if ver == self._version[bid] and blk.ref_cnt == 0 and blk.block_hash is not None:
                    self._push(blk)
        self._ranked_up_to = max(self._ranked_up_to, now)

    def _rank(self, blk: KVCacheBlock) -> int:
        h = blk.block_hash
        assert h is not None
        return self._next_use(h) if self.cached.get(h) is blk else NEVER

    def _push(self, blk: KVCacheBlock) -> None:
        rank, bid = self._rank(blk), blk.block_id
        ver = self._version[bid]
        heapq.heappush(self._heap, (-rank, -self.depth.get(blk.block_hash, 0), bid, ver))  # type: ignore[arg-type]
        if rank != NEVER:
            self._by_rank.setdefault(rank, []).append((bid, ver))

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
            neg_next, _, bid, ver = heapq.heappop(heap)
            blk = self.blocks[bid]
            if ver != self._version[bid] or blk.ref_cnt != 0:
                continue  # stale: taken by a hit since it was freed
            if self._rank(blk) != -neg_next:
                # Its next use was a lookup that missed it, or it became the map's copy: ranked again.
                self._push(blk)
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
            if blk.block_hash is None:
                self._empty.append(blk)
            else:
                self._push(blk)


def belady_note(host_blocks: int, run: ReplayResult) -> str:
    """What a reader must know of a Belady figure beside a replay: that a host tier's blocks were counted
    into its pool, that the replay waited, preempted or skipped (MIN is then not a bound)."""
    notes = [f"device + {host_blocks} host blocks as one pool"] if host_blocks else []
    if run.waited or run.preempted or run.skipped:
        notes.append("a heuristic here, not a bound: the replay waited, preempted or skipped")
    return "".join(f"; {n}" for n in notes)


def belady_hit_rate(trace: list[TraceRequest], num_blocks: int, block_size: int, concurrency: int,
                    hash_algo: str = "sha256", skip: Collection[int] = ()) -> float:
    """Hit rate of the trace under Belady's MIN eviction, with kvpool's call pattern and pool size (for a
    device and a host tier, their blocks together as one pool: no two-tier policy hits more). `skip`: the
    indices of requests the policy's own replay skipped (too large for its device pool alone), left out here
    too, so that both hit rates are over the same requests (a prompt that fits device + host but not the
    device was counted by Belady alone)."""
    if skip:
        left_out = set(skip)
        trace = [tr for i, tr in enumerate(trace) if i not in left_out]
    hasher = BlockHasher(block_size, hash_algo)
    uses: dict[BlockHash, list[int]] = {}
    depth: dict[BlockHash, int] = {}
    pool = BeladyBlockPool(num_blocks, uses, depth)  # (it reads the two maps filled below)
    usable = pool.num_usable_blocks
    for i, tr in enumerate(trace):
        req = CacheRequest(tr["id"], tr["prompt"] + tr["decode"], hasher=hasher)
        # (a prompt the pool cannot hold is skipped by the replay: its lookup never happens)
        n_lookup = (len(tr["prompt"]) - 1) // block_size if -(-len(tr["prompt"]) // block_size) <= usable else 0
        for d, h in enumerate(req.block_hashes):
            depth[h] = d
            if d < n_lookup:
                uses.setdefault(h, []).append(i)
    manager = KVCacheManager(num_blocks, block_size, block_pool=pool)

    return replay(trace, manager, hasher, concurrency, on_admit=pool.advance).hit_rate
