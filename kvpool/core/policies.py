"""Eviction policies beyond LRU, registered by name (`--eviction-policy NAME`, `--host-eviction NAME`).

- `slru`: segmented LRU, the frequency-aware policy. A released block that has been hit during its
  cached life waits in a protected segment, every other one in a probation segment evicted first:
  one-time prompts cannot flush prefixes that were reused. (Protected holds at most 80% of the pool's
  blocks, so new blocks always get room to prove themselves.)
- `prefix`: GreedyDual over what a block saves. A block's value is the number of requests whose
  prefix hit passed through it (a hit counts for every block of the hit chain) and the number of
  cached chains that branch off it; the value is raised along a chain so that a parent is never worth
  less than its child (a child is useless once its parent is gone).
- `reuse`: GreedyDual whose value is the reuse probability of the block's class, learned online
  (raised to a power, see `ReusePolicy.EXPONENT`). A block's class is what the system saw: whether its
  chain branched off a prefix that had been hit, how many blocks it lies past that branch point, how
  often it has been hit, how many tokens the request that released it generated (one bucket per
  doubling: a request answered in a few tokens, such as an agent's tool call, is often continued by
  the next request over the same context; a long chat answer less often, or much later), and its
  depth (hit blocks) or the length of the chain it was released with (never-hit blocks). Each cached
  life of a block is one trial of its class: a success when the block is hit; a failure when it is
  evicted, turned into a success if its hash is cached again while it is still in a ghost list of
  evicted hashes (as in ARC: a miss that the eviction caused; the block then counts as one that has
  been reused). Rates are shrunk toward the coarser classes (without the depth, then without the
  output length too) and decay, so the policy follows the traffic it sees (one-off suffixes after a
  shared document, finished conversations, which answers get continued) instead of constants tuned
  to one trace.

GreedyDual (Cao and Irani): a released block gets priority `clock + value`, the block with the lowest
priority is evicted and the clock moves up to it. With equal values this is LRU exactly (ties go to
the release order), and a block worth twice as much outlives its peers by about twice as long.
Every operation is O(log n): a heap with lazy deletion (an entry is live while its version matches).
Blocks without cached content wait in their own queue and are reused first; blocks released as low
value (`append_low_n`) come right after them, as in LRU.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from kvpool.core.block import BlockHash, KVCacheBlock
from kvpool.core.eviction import NoObservations, register_policy
from kvpool.core.free_queue import FreeBlockQueue

# Where a free block waits (per block id).
_NONE, _EMPTY, _LOW, _MAIN, _PROTECTED = 0, 1, 2, 3, 4


class _Slots(NoObservations):
    """What the policies here share: per-block-id state grown to the largest id seen (pools number
    their blocks from 0), where each free block waits, and the queues of empty blocks (reused first)
    and low-value blocks (next), which every policy keeps in the order it was given them."""

    def __init__(self) -> None:
        self.size = 0
        self.where: list[int] = []
        self.empty = FreeBlockQueue()
        self.low = FreeBlockQueue()

    def _grow(self, n: int) -> None:
        extra = n - self.size
        self.where += [_NONE] * extra
        self.size = n

    def ensure(self, blocks: Sequence[KVCacheBlock]) -> None:
        top = max(b.block_id for b in blocks) + 1
        if top > self.size:
            self._grow(top)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        self.ensure(blocks)
        self.empty.prepend_n(blocks)
        for b in blocks:
            self.where[b.block_id] = _EMPTY

    def append_low_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        self.ensure(blocks)
        for b in blocks:
            self.low.append(b)
            self.where[b.block_id] = _LOW

    def _take_n(self, n: int, evict: Callable[[], KVCacheBlock]) -> list[KVCacheBlock]:
        """n free blocks: empty ones first, then low-value ones, then what `evict` picks."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        out = []
        for _ in range(n):
            if self.empty.num_free_blocks:
                blk = self.empty.popleft()
            elif self.low.num_free_blocks:
                blk = self.low.popleft()
            else:
                blk = evict()
            self.where[blk.block_id] = _NONE
            out.append(blk)
        return out


class SLRUPolicy(_Slots):
    """Segmented LRU: probation (never hit while cached) is evicted before protected (hit again)."""

    name = "slru"
    observes = True
    PROTECTED_SHARE = 0.8  # the usual SLRU split: probation keeps room to prove new blocks

    def __init__(self) -> None:
        super().__init__()
        self.probation = FreeBlockQueue()
        self.protected = FreeBlockQueue()
        self.hit: list[bool] = []

    def _grow(self, n: int) -> None:
        self.hit += [False] * (n - self.size)
        super()._grow(n)

    @property
    def num_free_blocks(self) -> int:  # type: ignore[override]
        return (self.empty.num_free_blocks + self.low.num_free_blocks + self.probation.num_free_blocks
                + self.protected.num_free_blocks)

    def _queue(self, where: int) -> FreeBlockQueue:
        return (self.empty, self.low, self.probation, self.protected)[where - 1]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return self._take_n(n, lambda: (self.probation if self.probation.num_free_blocks else self.protected).popleft())

    def remove(self, block: KVCacheBlock) -> None:
        w = self.where[block.block_id] if block.block_id < self.size else _NONE
        if w == _NONE:
            raise ValueError(f"block {block.block_id} is not free")
        self._queue(w).remove(block)
        self.where[block.block_id] = _NONE

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        self.ensure(blocks)
        for b in blocks:
            where = _PROTECTED if self.hit[b.block_id] else _MAIN
            self._queue(where).append(b)
            self.where[b.block_id] = where
        # Keep probation its share of the pool: demote the least recent protected blocks.
        cap = self.PROTECTED_SHARE * self.size
        while self.protected.num_free_blocks > cap:
            b = self.protected.popleft()
            self.probation.append(b)
            self.where[b.block_id] = _MAIN

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self.empty
        yield from self.low
        yield from self.probation
        yield from self.protected

    def on_touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        hit = self.hit
        for b in blocks:
            if b.block_hash is not None and b.block_id < self.size:
                hit[b.block_id] = True

    def on_uncached(self, block: KVCacheBlock) -> None:
        if block.block_id < self.size:
            self.hit[block.block_id] = False


class GreedyDualPolicy(_Slots):
    """GreedyDual eviction (see module doc); subclasses say what a released block is worth."""

    name = "greedy-dual"
    observes = True

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0
        self._heap: list[tuple[float, int, int]] = []  # (priority, sequence, block id)
        self._seq = 0
        self._live: list[int] = []  # the sequence number of a block's live heap entry
        self._blocks: list[KVCacheBlock | None] = []
        self._num_main = 0

    def _grow(self, n: int) -> None:
        extra = n - self.size
        self._live += [-1] * extra
        self._blocks += [None] * extra
        super()._grow(n)

    def value(self, block: KVCacheBlock) -> float:
        """What keeping the released `block` is worth (the same value for all: LRU)."""
        return 1.0

    @property
    def num_free_blocks(self) -> int:  # type: ignore[override]
        return self.empty.num_free_blocks + self.low.num_free_blocks + self._num_main

    def _pop_main(self) -> KVCacheBlock:
        heap, live = self._heap, self._live
        while True:
            prio, seq, bid = heapq.heappop(heap)
            if live[bid] == seq:
                live[bid] = -1
                self._num_main -= 1
                self.clock = prio  # GreedyDual's inflation: later releases start from here
                return self._blocks[bid]  # type: ignore[return-value]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return self._take_n(n, self._pop_main)

    def remove(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        w = self.where[bid] if bid < self.size else _NONE
        if w == _NONE:
            raise ValueError(f"block {bid} is not free")
        if w == _MAIN:
            self._live[bid] = -1  # its heap entry goes stale
            self._num_main -= 1
            if len(self._heap) > 2 * self._num_main + 64:
                self._compact()
        else:
            (self.empty if w == _EMPTY else self.low).remove(block)
        self.where[bid] = _NONE

    def _compact(self) -> None:
        live = self._live
        self._heap = [e for e in self._heap if live[e[2]] == e[1]]
        heapq.heapify(self._heap)

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        self.ensure(blocks)
        # Blocks come tail of a chain first. A block is worth at least its most valuable descendant
        # released with it (the descendant is useless without it): a running maximum keeps a parent
        # at or above its children, and equal priorities go in the given order.
        best = 0.0
        heap, clock = self._heap, self.clock
        for b in blocks:
            v = self.value(b)
            if v > best:
                best = v
            bid = b.block_id
            self._seq += 1
            heapq.heappush(heap, (clock + best, self._seq, bid))
            self._live[bid] = self._seq
            self._blocks[bid] = b
            self.where[bid] = _MAIN
        self._num_main += len(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self.empty
        yield from self.low
        live = self._live
        for _, _seq, bid in sorted(e for e in self._heap if live[e[2]] == e[1]):
            yield self._blocks[bid]  # type: ignore[misc]


class PrefixPolicy(GreedyDualPolicy):
    """GreedyDual valuing a block by the requests that passed through it and the chains under it."""

    name = "prefix"

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[int] = []
        self.children: list[int] = []
        self.parent: list[int] = []  # the id of the block holding the previous block of the chain

    def _grow(self, n: int) -> None:
        extra = n - self.size
        self.hits += [0] * extra
        self.children += [0] * extra
        self.parent += [-1] * extra
        super()._grow(n)

    def value(self, block: KVCacheBlock) -> float:
        bid = block.block_id
        # Logarithms: a block hit by 1000 requests should outlive a one-off, not outlive the
        # whole rest of the cache forever (GreedyDual's clock has to catch up with it eventually).
        return 1.0 + math.log2(1 + self.hits[bid]) + math.log2(1 + self.children[bid])

    def on_touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        self.ensure(blocks)
        hits = self.hits
        for b in blocks:
            if b.block_hash is not None:
                hits[b.block_id] += 1

    def on_cached(self, block: KVCacheBlock, index: int, parent: KVCacheBlock | None) -> None:
        self.ensure((block,) if parent is None else (block, parent))
        bid = block.block_id
        self.hits[bid] = 0
        self.children[bid] = 0
        if parent is not None and parent.block_hash is not None:
            self.parent[bid] = parent.block_id
            self.children[parent.block_id] += 1
        else:
            self.parent[bid] = -1

    def on_uncached(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if bid >= self.size:
            return
        p = self.parent[bid]
        if p >= 0 and self.children[p] > 0:
            self.children[p] -= 1
        self.parent[bid] = -1
        self.hits[bid] = 0


# -- the learned-reuse policy -------------------------------------------------------------------------

_N_DEPTH = 24  # depth buckets: int(2 * log2(index + 1)), two per doubling, capped
_N_COARSE = 9  # 3 chain positions x 2 (branched or not), then 3 hit-count buckets
# Output-length buckets of the request that released a block: 0 not known, then one per doubling of
# the tokens it generated (1: none, 2: one, 3: 2-3, ... 12: 1024 or more).
_N_OUT = 13
_N_MID = _N_COARSE * _N_OUT


def _out_bucket(n: int | None) -> int:
    if n is None:
        return 0
    b = n.bit_length() + 1 if n > 0 else 1
    return b if b < _N_OUT else _N_OUT - 1


def _depth_bucket(d: int) -> int:
    """About int(2 * log2(d + 1)), capped: two buckets per doubling, from bit lengths (no float math)."""
    x = d + 1
    n = x.bit_length()
    b = 2 * (n - 1) + ((x >> (n - 2)) & 1 if n > 1 else 0)
    return b if b < _N_DEPTH else _N_DEPTH - 1


def _dist_bucket(d: int) -> int:
    return 0 if d <= 1 else (1 if d <= 7 else 2)


def _hit_bucket(h: int) -> int:
    return 0 if h <= 1 else (1 if h <= 3 else 2)


class ReusePolicy(GreedyDualPolicy):
    """GreedyDual with each block worth its class's reuse probability, learned online (module doc)."""

    name = "reuse"
    PRIOR = 4.0  # pseudo-trials pulling a class's rate toward its coarser class (shrinkage)
    # Ghost list length in pools: a first reuse often comes pool turnovers after the block was
    # cached (on the Mooncake trace the median is ~3 turnovers at 2048 blocks); a ghost is a hash
    # and an int, so remembering a few pools costs little.
    GHOST_POOLS = 4
    # GreedyDual gives a block a life proportional to its value; with value p**EXPONENT a block
    # twice as likely to be reused lives 16 times as long, so the pool fills with the classes that
    # pay off instead of sharing itself evenly (sensitivity in docs/benchmarks.md).
    EXPONENT = 4

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[int] = []  # hits in the current cached life (1 after a ghost return)
        self.dist: list[int] = []  # blocks since the chain left a prefix that had been hit
        self.branched: list[bool] = []  # whether the chain left such a prefix (False: a new chain)
        self.depth: list[int] = []
        self.chain: list[int] = []  # never-hit blocks: the length of the chain released with them
        self.cls: list[int] = []  # the open trial's class (-1: none)
        self.hash_of: list[BlockHash | None] = []  # the pool clears the hash before `on_uncached`
        self.out: list[int] = []  # output bucket of the request that last released the block
        self._out = 0  # ... of the request releasing blocks now (`on_release`)
        n_fine = _N_MID * _N_DEPTH
        self.pos = [0.0] * n_fine
        self.cnt = [0.0] * n_fine
        self.pos_m = [0.0] * _N_MID
        self.cnt_m = [0.0] * _N_MID
        self.pos_c = [0.0] * _N_COARSE
        self.cnt_c = [0.0] * _N_COARSE
        self.pos_g = 0.0
        self.cnt_g = 0.0
        # Evicted hashes -> (class of their trial << 20) | hits, oldest first (GHOST_POOLS pools).
        self.ghosts: OrderedDict[BlockHash, int] = OrderedDict()
        self.ghost_cap = 0
        self._window = 1024.0
        # Values by class, recomputed (lazily, per class) once every REFRESH credits: a rate moves
        # little in that many trials, and a table lookup keeps a block's release cheap.
        self._vtab = [0.0] * n_fine
        self._vver = [-1] * n_fine
        self._ver = 0
        self._stale = 0

    def _grow(self, n: int) -> None:
        extra = n - self.size
        self.hits += [0] * extra
        self.dist += [0] * extra
        self.branched += [False] * extra
        self.depth += [0] * extra
        self.chain += [0] * extra
        self.cls += [-1] * extra
        self.out += [0] * extra
        self.hash_of += [None] * extra
        super()._grow(n)
        self.ghost_cap = self.GHOST_POOLS * n
        # Forget with a half-life of a few pools' worth of trials: the rates follow the traffic.
        self._window = max(1024.0, 4.0 * n)

    def _class(self, bid: int) -> int:
        h = self.hits[bid]
        coarse = (6 + _hit_bucket(h) if h
                  else 3 * self.branched[bid] + _dist_bucket(self.dist[bid]))
        # Then by how much the releasing request generated; hit blocks by their own depth (a
        # conversation's turn), never-hit ones by the length of the prompt they came with (long
        # documents are reused more often than short one-off prompts).
        mid = coarse * _N_OUT + self.out[bid]
        return mid * _N_DEPTH + _depth_bucket(self.depth[bid] if h else self.chain[bid])

    def _credit(self, fine: int, success: bool, trial: bool = True) -> None:
        """Count a trial of class `fine` (`trial`), a success (`success`), or both."""
        mid = fine // _N_DEPTH
        coarse = mid // _N_OUT
        s = 1.0 if success else 0.0
        t = 1.0 if trial else 0.0
        self.pos[fine] += s
        self.cnt[fine] += t
        self.pos_m[mid] += s
        self.cnt_m[mid] += t
        self.pos_c[coarse] += s
        self.cnt_c[coarse] += t
        self.pos_g += s
        self.cnt_g += t
        self._stale += 1
        if self._stale >= self.REFRESH:
            self._stale = 0
            self._ver += 1
        if self.cnt_g > self._window:
            # Exponential forgetting: halve every count (amortized O(1): once per window).
            self.pos = [x * 0.5 for x in self.pos]
            self.cnt = [x * 0.5 for x in self.cnt]
            self.pos_m = [x * 0.5 for x in self.pos_m]
            self.cnt_m = [x * 0.5 for x in self.cnt_m]
            self.pos_c = [x * 0.5 for x in self.pos_c]
            self.cnt_c = [x * 0.5 for x in self.cnt_c]
            self.pos_g *= 0.5
            self.cnt_g *= 0.5

    def rate(self, fine: int) -> float:
        """The estimated reuse probability of a class, shrunk toward its coarser classes and the mean."""
        k = self.PRIOR
        p_g = min(1.0, (self.pos_g + 1.0) / (self.cnt_g + 2.0))
        m = fine // _N_DEPTH
        c = m // _N_OUT
        p_c = min(1.0, (self.pos_c[c] + k * p_g) / (self.cnt_c[c] + k))
        p_m = min(1.0, (self.pos_m[m] + k * p_c) / (self.cnt_m[m] + k))
        return min(1.0, (self.pos[fine] + k * p_m) / (self.cnt[fine] + k))

    REFRESH = 16

    def value(self, block: KVCacheBlock) -> float:
        c = self.cls[block.block_id]
        if c < 0:
            return 0.5 ** self.EXPONENT
        if self._vver[c] != self._ver:
            self._vtab[c] = self.rate(c) ** self.EXPONENT
            self._vver[c] = self._ver
        return self._vtab[c]

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if blocks:
            self.ensure(blocks)
            # The chain released together: its length is the prompt's (plus output) for the
            # blocks that were never hit, whose class is known only now. And every block released
            # is classed by what the releasing request generated: its next trial is about this
            # release.
            depth, hits, cls, chain, out, o = self.depth, self.hits, self.cls, self.chain, self.out, self._out
            top = max(depth[b.block_id] for b in blocks) + 1
            for b in blocks:
                bid = b.block_id
                c = cls[bid]
                if c == -2 or (c >= 0 and ((not hits[bid] and chain[bid] != top) or out[bid] != o)):
                    if not hits[bid]:
                        chain[bid] = top
                    out[bid] = o
                    cls[bid] = self._class(bid)
        super().append_n(blocks)

    def on_release(self, num_output_tokens: int | None) -> None:
        self._out = _out_bucket(num_output_tokens)

    def on_touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        self.ensure(blocks)
        for b in blocks:
            if b.block_hash is None:
                continue
            bid = b.block_id
            if self.cls[bid] == -2:
                self.cls[bid] = self._class(bid)
            if self.cls[bid] >= 0:
                self._credit(self.cls[bid], True)  # the trial succeeded: the block was reused
            self.hits[bid] += 1
            self.cls[bid] = self._class(bid)  # a new trial, as a block hit this often

    def on_cached(self, block: KVCacheBlock, index: int, parent: KVCacheBlock | None) -> None:
        self.ensure((block,) if parent is None else (block, parent))
        bid = block.block_id
        h = block.block_hash
        ghost = self.ghosts.pop(h, None) if h is not None else None
        if ghost is not None:
            # Computed again after its eviction: that eviction cost a hit. The trial (counted as a
            # failure at eviction) becomes a success, and the block is one that has been reused.
            c_old, h_old = divmod(ghost, 1 << 20)
            self._credit(c_old, True, trial=False)
            self.hits[bid] = h_old + 1
        else:
            self.hits[bid] = 0
        if parent is None:
            self.branched[bid] = False
            self.dist[bid] = 1
        else:
            pid = parent.block_id
            if self.hits[pid]:
                self.branched[bid] = True  # leaves a prefix that has been reused
                self.dist[bid] = 1
            else:
                self.branched[bid] = self.branched[pid]
                self.dist[bid] = self.dist[pid] + 1
        self.depth[bid] = index
        self.chain[bid] = index + 1
        # The class of a never-hit block depends on the chain it is released with: computed then
        # (or at a hit before that); -2 marks the trial open with its class still to come.
        self.cls[bid] = -2 if ghost is None else self._class(bid)
        self.hash_of[bid] = h

    def on_uncached(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if bid >= self.size or self.cls[bid] == -1:
            return
        if self.cls[bid] == -2:
            self.cls[bid] = self._class(bid)
        h = self.hash_of[bid]
        c = self.cls[bid]
        self.cls[bid] = -1
        self.hash_of[bid] = None
        hits = self.hits[bid]
        self.hits[bid] = 0
        # The trial counts as a failure now; a return from the ghost list turns it into a success
        # (learning must not wait for the ghost list to forget: it is several pools long).
        self._credit(c, False)
        if h is None:
            return
        ghosts = self.ghosts
        ghosts.pop(h, None)
        ghosts[h] = (c << 20) | min(hits, (1 << 20) - 1)
        if len(ghosts) > self.ghost_cap:
            ghosts.popitem(last=False)


register_policy("slru", SLRUPolicy)
register_policy("prefix", PrefixPolicy)
register_policy("reuse", ReusePolicy)
