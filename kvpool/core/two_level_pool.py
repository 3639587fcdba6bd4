"""Two-level pages: one memory pool for layer groups whose pages differ in size (the RFC's milestone 2).

Memory is cut into large pages of `lcm(page sizes)` bytes. A large page is either unowned or owned by
one page size ("type"), which splits it into `large / small` small pages; block id j of a type is
bytes [j * small, (j + 1) * small) of the pool, so it lies in large page j // per_large and the runner
can view the same buffer as one tensor per type. Large page 0 is reserved: block 0 of every type in
it is that type's null block.

Each type is a `SmallPagePool`, a `BlockPool` the per-type managers use unchanged (its own hash map,
ref counts, KV events). `TwoLevelBlockPool` owns the large pages and decides where a new small page
comes from, in this order:

1. a free page in a large page the type already partly uses: uncached first, then the type's
   eviction order (its least recently used cached page; pages the manager released "to the front"
   before it);
2. otherwise a whole free large page: unowned ones first, then the least recently used large page
   among all types whose small pages are all unused (its recency is its most recently freed cached
   page); a large page of another type has its cached pages evicted and changes owner.

So the LRU runs over cached pages of all types at large-page granularity, and within a type over its
small pages. Using partly used large pages first keeps a type's pages packed (less fragmentation) and
makes the room check exact: `plan_groups` computes, without changing anything, how many whole large
pages each type would need after this allocation's releases and hits, and the allocation takes
exactly those; so a failed allocation changes nothing and an accepted one never runs out midway.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from kvpool.core.block import KVCacheBlock
from kvpool.core.block_pool import AllocationPlan, BlockPool
from kvpool.core.events import KVCacheEvent
from kvpool.core.free_queue import FreeBlockQueue

_UNOWNED_RECENCY = -1  # unowned large pages are taken before any owned one (they hold nothing)


class SmallPagePool(BlockPool):
    """One page size's view of the two-level pool. Free pages of large pages it partly uses sit in
    its free queue; pages of its wholly free large pages are parked in the parent until taken."""

    def __init__(self, parent: TwoLevelBlockPool, type_id: int, page_size: int, per_large: int) -> None:
        super().__init__(parent.num_large_pages * per_large, enable_caching=parent.enable_caching,
                         enable_kv_events=parent.enable_kv_events)
        self.parent = parent
        self.type_id = type_id
        self.page_size = page_size
        self.per_large = per_large
        self.free_block_queue = FreeBlockQueue()
        # When each page was last freed with cached content (0: uncached or released to the front).
        self.stamp = [0] * self.num_blocks

    def large_page(self, blk: KVCacheBlock) -> int:
        return blk.block_id // self.per_large

    def pages_of(self, lp: int) -> list[KVCacheBlock]:
        return self.blocks[lp * self.per_large:(lp + 1) * self.per_large]

    # -- the tier interface -------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free pages in large pages this type partly uses (whole free large pages are the parent's)."""
        return self.free_block_queue.num_free_blocks

    def free_block_ids(self) -> list[int]:
        return self.free_block_queue.block_ids()

    def get_new_blocks(self, num_blocks: int, plan: AllocationPlan | None = None) -> list[KVCacheBlock]:
        out = []
        parent, q = self.parent, self.free_block_queue
        for _ in range(num_blocks):
            if q.num_free_blocks == 0:
                parent.take_large_page(self)
            elif plan is not None and plan.spare > 0:
                head = next(iter(q))
                stamp = self.stamp[head.block_id]
                oldest = parent.oldest_parked_recency()
                if stamp > 0 and oldest is not None and oldest < stamp:
                    # One LRU over all types: a wholly free large page used less recently than this
                    # type's next victim goes first (unless the victim was released to the front:
                    # then it goes first, and the type's large pages stay packed).
                    plan.spare -= 1
                    parent.take_large_page(self)
            blk = q.popleft()
            if blk.block_hash is not None:
                self._uncache(blk)
            blk.ref_cnt = 1
            self.parent.used[self.large_page(blk)] += 1
            out.append(blk)
        return out

    def _take_free(self, blk: KVCacheBlock) -> None:
        lp = self.large_page(blk)
        if self.parent.used[lp] == 0:
            self.parent.unpark(self, lp)
        self.free_block_queue.remove(blk)
        self.parent.used[lp] += 1

    def _released(self, first: list[KVCacheBlock], last: list[KVCacheBlock],
                  low: Sequence[KVCacheBlock] = ()) -> None:
        # Low-value pages go to the front like empty ones: a type's queue is short and its large pages
        # stay packed (the whole-page LRU across types ranks them by their most recent cached page).
        for blk in reversed([*first, *low]):  # each to the front: reversed, so the first given ends up first
            self._release(blk, front=True)
        for blk in last:
            self._release(blk, front=False)

    def _release(self, blk: KVCacheBlock, front: bool) -> None:
        """A page whose ref_cnt reached 0 goes to this type's free queue (its large page to the parent
        once every page of it is free)."""
        if not front:
            self.parent.clock += 1
            self.stamp[blk.block_id] = self.parent.clock
            self.free_block_queue.append(blk)
        else:
            self.stamp[blk.block_id] = 0
            self.free_block_queue.appendleft(blk)
        lp = self.large_page(blk)
        self.parent.used[lp] -= 1
        if self.parent.used[lp] == 0:
            self.parent.park(self, lp)


class TwoLevelBlockPool:
    """Large pages of lcm(page sizes) bytes, split on demand into small pages of one type each."""

    def __init__(self, num_large_pages: int, group_page_sizes: Sequence[int], *, enable_caching: bool = True,
                 enable_kv_events: bool = False) -> None:
        if num_large_pages < 2:
            raise ValueError(f"num_large_pages: need at least 2 (one holds the null blocks), got {num_large_pages}")
        if not group_page_sizes or any(not isinstance(p, int) or p < 1 for p in group_page_sizes):
            raise ValueError(f"page_sizes: need positive ints, got {list(group_page_sizes)}")
        self.num_large_pages = num_large_pages
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.large_page_size = math.lcm(*group_page_sizes)
        sizes = sorted(set(group_page_sizes))
        self.types = [SmallPagePool(self, t, p, self.large_page_size // p) for t, p in enumerate(sizes)]
        self.group_types = [sizes.index(p) for p in group_page_sizes]
        self.owner: list[int | None] = [None] * num_large_pages
        self.used = [0] * num_large_pages  # small pages with ref_cnt > 0, per large page
        self.clock = 0
        # Wholly free large pages: heap of (recency, version, large page); an entry is stale when the
        # page's version moved on (it was taken, or freed again with another recency).
        self.version = [0] * num_large_pages
        self.parked: list[tuple[int, int, int]] = [(_UNOWNED_RECENCY, 0, lp) for lp in range(1, num_large_pages)]
        heapq.heapify(self.parked)
        self.num_parked = num_large_pages - 1
        self.owner[0] = -1  # the null large page
        self.null_block = None
        self.num_blocks = num_large_pages
        self.num_usable_blocks = num_large_pages - 1
        self.eviction_listeners: list[object] = []

    def view(self, group_id: int) -> SmallPagePool:
        return self.types[self.group_types[group_id]]

    # -- large pages --------------------------------------------------------------------------------

    def park(self, pool: SmallPagePool, lp: int) -> None:
        """All of a large page's small pages are unused: it may go to any type."""
        pages = pool.pages_of(lp)
        recency = max(pool.stamp[b.block_id] for b in pages)
        for b in pages:
            pool.free_block_queue.remove(b)
        self.version[lp] += 1
        heapq.heappush(self.parked, (recency, self.version[lp], lp))
        self.num_parked += 1

    def unpark(self, pool: SmallPagePool, lp: int) -> None:
        """A parked large page goes back to its owner's free queue (a hit, or the owner needs room)."""
        assert self.owner[lp] == pool.type_id and self.used[lp] == 0
        self.version[lp] += 1
        self.num_parked -= 1
        pages = sorted(pool.pages_of(lp), key=lambda b: pool.stamp[b.block_id], reverse=True)
        # Ahead of the type's other free pages, oldest first: filling partly used large pages first
        # keeps large pages whole for other types.
        for b in pages:
            pool.free_block_queue.appendleft(b)

    def oldest_parked_recency(self) -> int | None:
        parked = self.parked
        while parked and parked[0][1] != self.version[parked[0][2]]:
            heapq.heappop(parked)  # stale
        return parked[0][0] if parked else None

    def take_large_page(self, pool: SmallPagePool) -> None:
        """Give `pool` the unowned or least recently used wholly free large page."""
        if self.oldest_parked_recency() is None:
            raise ValueError("two-level pool: no free large page left")
        _, _, lp = heapq.heappop(self.parked)
        prev = self.owner[lp]
        if prev == pool.type_id:
            self.unpark(pool, lp)
            return
        self.num_parked -= 1
        self.version[lp] += 1
        if prev is not None:
            old = self.types[prev]
            for b in old.pages_of(lp):
                if b.block_hash is not None:
                    old._uncache(b)
                old.stamp[b.block_id] = 0
        self.owner[lp] = pool.type_id
        for b in reversed(pool.pages_of(lp)):  # ascending ids at the head
            pool.free_block_queue.appendleft(b)

    def plan_groups(self, need: Sequence[int], skipped: Sequence[Sequence[KVCacheBlock]],
                    hits: Sequence[Sequence[KVCacheBlock]]) -> AllocationPlan | None:
        """Whether groups needing `need[g]` free pages (new ones plus free hits) fit once the skipped
        pages this request alone holds are released and the hits taken: the plan the allocation then
        follows, or None. Changes nothing."""
        used: dict[int, int] = {}
        queued = [t.free_block_queue.num_free_blocks for t in self.types]
        new = [0] * len(self.types)
        parked = self.num_parked
        for g, n in enumerate(need):
            new[self.group_types[g]] += n
        for g, blocks in enumerate(skipped):
            t = self.view(g)
            for b in blocks:
                if b.ref_cnt != 1 or b.is_null:
                    continue
                lp = t.large_page(b)
                used[lp] = used.get(lp, self.used[lp]) - 1
                queued[t.type_id] += 1
                if used[lp] == 0:
                    parked += 1
                    queued[t.type_id] -= t.per_large
        for g, blocks in enumerate(hits):
            t = self.view(g)
            for b in blocks:
                if b.ref_cnt != 0 or b.is_null or b.on_host:
                    continue  # host hits need a new page: counted in `need` and left there
                lp = t.large_page(b)
                u = used.get(lp, self.used[lp])
                if u == 0:
                    parked -= 1
                    queued[t.type_id] += t.per_large
                used[lp] = u + 1
                queued[t.type_id] -= 1
                new[t.type_id] -= 1
        wanted = sum(-(-max(0, new[t.type_id] - queued[t.type_id]) // t.per_large) for t in self.types)
        if wanted > parked:
            return None
        # Large pages beyond the need: a type may open one rather than evict a more recent page of its own.
        return AllocationPlan(spare=parked - wanted)

    # -- what KVCacheManager asks of its pool -------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Wholly free large pages."""
        return self.num_parked

    @property
    def usage(self) -> float:
        return 1.0 - self.num_parked / self.num_usable_blocks

    def bytes_in_use(self) -> int:
        """Bytes of the large pages not wholly free (what the pool cannot give another type now)."""
        return (self.num_usable_blocks - self.num_parked) * self.large_page_size

    @property
    def blocks(self) -> list[KVCacheBlock]:
        return [b for t in self.types for b in t.blocks]

    @property
    def cached(self) -> dict[bytes, KVCacheBlock]:
        return {h: b for t in self.types for h, b in t.cached.items()}

    def free_block_ids(self) -> list[tuple[int, ...]]:
        """Each type's free queue, then the parked large pages in the order they would be taken."""
        live = sorted(e for e in self.parked if e[1] == self.version[e[2]])
        return [tuple(t.free_block_ids()) for t in self.types] + [tuple(lp for _, _, lp in live)]

    def note_release(self, num_output_tokens: int | None) -> None:
        pass  # LRU only: nothing learns from releases

    def reset_prefix_cache(self) -> bool:
        if self.num_parked != self.num_usable_blocks:
            return False
        for t in self.types:
            t.forget_cached()
        return True

    def take_events(self) -> list[KVCacheEvent]:
        return [e for t in self.types for e in t.take_events()]

    def check_integrity(self) -> None:
        """No page both free and in use, ref counts never negative, every cached hash on a page that
        carries it, and a large page never handed to two types at once."""
        live = [e for e in self.parked if e[1] == self.version[e[2]]]
        parked = {lp for _, _, lp in live}
        assert len(live) == len(parked) == self.num_parked, "a large page is parked twice or the count is off"
        for t in self.types:
            queued = set(t.free_block_ids())
            assert len(queued) == t.free_block_queue.num_free_blocks
            for b in t.blocks:
                assert b.ref_cnt >= 0, f"type {t.type_id} page {b.block_id} has ref_cnt {b.ref_cnt}"
                lp = t.large_page(b)
                if b.is_null:
                    assert lp == 0 and b.block_id == 0 and b.block_hash is None
                    continue
                mine = self.owner[lp] == t.type_id
                if not mine:
                    assert b.ref_cnt == 0 and b.block_hash is None and b.block_id not in queued, (
                        f"type {t.type_id} page {b.block_id} is in large page {lp} owned by {self.owner[lp]}")
                elif b.ref_cnt > 0:
                    assert b.block_id not in queued and lp not in parked, f"page {b.block_id} is free and in use"
                else:
                    assert (b.block_id in queued) != (lp in parked), (
                        f"type {t.type_id} page {b.block_id}: free but neither queued nor parked (or both)")
            for lp in range(1, self.num_large_pages):
                if self.owner[lp] == t.type_id:
                    assert self.used[lp] == sum(1 for b in t.pages_of(lp) if b.ref_cnt > 0), f"large page {lp}"
                    assert (self.used[lp] == 0) == (lp in parked), f"large page {lp}: parked iff unused"
            t.check_map()
        for lp in range(1, self.num_large_pages):
            if self.owner[lp] is None:
                assert lp in parked and self.used[lp] == 0, f"unowned large page {lp} is not free"
