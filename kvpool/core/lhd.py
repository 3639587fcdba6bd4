"""`lhd`: evict the cached block with the lowest hit density, learned online (Beckmann et al., NSDI'18).

A cached free block costs space for as long as it stays, and pays off only if it is hit before it is
evicted. LHD ranks a block by its expected hits per unit of space-time: for its class `c` and its age
`a` (allocations since it was last released),

    density(c, a) = P(hit | c, age >= a) / E[remaining lifetime | c, age >= a]

both read off histograms of the ages at which blocks of the class were hit or evicted, counted from
what the pool does (hits on free blocks, evictions) and decayed, so the ranking follows the traffic.
Unlike a reuse probability, this says *how soon* a block pays per block of pool it holds: a
conversation that comes back within half a pool is worth more than one that comes back, as often,
three pools later, and a class whose hits all come early is given up once it is past that age.

Classes are what the system sees of a block:
- how often it was hit during its cached life (0, 1, 2-3, 4+; a block computed again while its hash
  was in the ghost list below counts as hit: it was reused),
- its lineage: how many times its prefix was hit and extended by a later request (0: a new chain;
  +1 every time a request hits a prefix and caches blocks past it). In a conversation this is the
  turn (and a conversation with more turns behind it has fewer ahead); after a shared document, 1
  for the one-off question. The lineage of the chain a block was released with (its deepest
  released block) is what counts: the blocks of one chain are reused together.
(The length of the released chain was tried as a third feature: on the development traces it did not
help and it split the counts 16 ways, so it is not used.) Sparse classes are shrunk toward the whole
pool's histograms (`PRIOR` events of the same shape).

Hits: a hit on a free block counts at its age; a hit on a block in use (shared by a request in
flight) counts at age 0 (it has not been a candidate since its last access).

Observing past the eviction: an evicted block's event is not counted at once. If its hash is cached
again within `WINDOW_POOLS` pools of allocations after the eviction (the eviction cost a hit), a hit
counts at the age it came back; if not, an eviction counts at the age it would have reached at the
window's end. Every evicted block is so observed for one window more than it lived, hits and
exposure alike. Without this the histograms would see only hits younger than the current eviction
age, and a class evicted before its reuse would never show it (LHD keeps a few "explorer" blocks
longer for the same reason; this costs no pool space). Counting the returns without the exposure of
the blocks that did not return would make every old age look valuable (tried: it lost half of
LRU's hits on the Mooncake trace). A separate, longer ghost list (`GHOST_POOLS` pools of hashes)
only carries a block's hit count and lineage over its eviction.

Chains: a child block is useless without its parent (a hit runs from the root), so only leaves are
candidates: free cached blocks with no free cached child (in use children do not count: their
request holds the path it needs). Leaves are kept in an array (O(1) add, swap-remove, random sample);
a parent becomes a candidate when its last free child goes.

Eviction samples up to `SAMPLES` leaves at random (all of them when there are fewer: small pools are
exact) and evicts the lowest density, ties to the oldest release: with no statistics yet this is
LRU among the leaves. The density table is recomputed every eighth of a pool's evictions (numpy,
classes x age bins), with exponential decay of the counts (half-life `HALF_LIFE_POOLS` pools of
evictions). Per eviction the cost is O(SAMPLES), independent of the pool size.
Blocks without cached content are reused first and low-value blocks next, as with every policy.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import accumulate

from kvpool.core.block import BlockHash, KVCacheBlock
from kvpool.core.eviction import register_policy
from kvpool.core.policies import _EMPTY, _MAIN, _NONE, _Slots

_N_HIT = 4  # hit-count buckets: 0, 1, 2-3, 4+
_N_LIN = 8  # lineage buckets: 0 .. 6, 7+
_N_CLASS = _N_HIT * _N_LIN
_N_AGE = 128  # age bins; a bin is 1/32 of the pool's allocations (4 pools), older ages share the last


def _hit_bucket(h: int) -> int:
    return h if h < 2 else (2 if h < 4 else 3)


def _class(hits: int, lineage: int) -> int:
    return _hit_bucket(hits) * _N_LIN + (lineage if lineage < _N_LIN else _N_LIN - 1)


class LHDPolicy(_Slots):
    """Least hit density (module doc): learned per-class hit/eviction age histograms, sampled leaves."""

    name = "lhd"
    observes = True
    SAMPLES = 32  # candidates per eviction (LHD's associativity)
    PRIOR = 8.0  # events of the pool-wide histograms added to each class (shrinkage)
    HALF_LIFE_POOLS = 4.0  # counts halve every this many pools of evictions
    GHOST_POOLS = 4  # evicted hashes remembered, in pools
    WINDOW_POOLS = 0.5  # how much longer than its actual life an evicted block is observed, in pools

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.now = 0  # blocks handed out: the policy's clock
        self.blocks: list[KVCacheBlock | None] = []
        self.hits: list[int] = []
        self.lineage: list[int] = []
        self.depth: list[int] = []
        self.rel: list[int] = []  # clock at the last release
        self.seq: list[int] = []  # release order (ties in density go to the earliest released)
        self._seq = 0
        self.cls: list[int] = []  # class assigned at the last release
        self.gen: list[int] = []  # bumped each time the block is handed out (parent links check it)
        self.plink: list[int] = []  # parent block id (-1: none) ...
        self.pgen: list[int] = []  # ... valid while the parent's gen is this
        # The parent whose free-child count includes this block (-1), a count that stands while the
        # parent's gen is the block's pgen: a parent handed out for new content (from any queue, the
        # low queue of blocks that slid out of a window too) is no longer its parent, and its count
        # starts again at 0. (A stale count kept would let the reused block become, say, its former
        # child's child: two blocks each waiting for the other to go, never a leaf, never evicted.)
        self.counted: list[int] = []
        self.nfree_child: list[int] = []
        self.leaf_pos: list[int] = []  # index in `leaves`, -1 if not a leaf
        self.leaves: list[int] = []
        self._num_main = 0
        # Histograms (flat: class * _N_AGE + age bin) and the density table read by evictions.
        self.h_hit = [0.0] * (_N_CLASS * _N_AGE)
        self.h_evict = [0.0] * (_N_CLASS * _N_AGE)
        self.dens = [0.0] * (_N_CLASS * _N_AGE)
        self.gran = 1  # allocations per age bin
        self._since_refresh = 0
        self.refresh_every = 64
        self.decay = 1.0
        # Evicted hash -> (hits, lineage), oldest first, GHOST_POOLS pools of them: a block computed
        # again after its eviction is one that has been reused.
        self.ghosts: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()
        self.ghost_cap = 0
        # Evictions whose event is not counted yet: hash -> (class, release clock, eviction clock),
        # oldest first. Within `window` allocations of its eviction, a return counts as a hit at its
        # age; past that the event counts as an eviction at age + window (see `_settle`).
        self.pending: OrderedDict[BlockHash, tuple[int, int, int]] = OrderedDict()
        self.window = 1

    def _grow(self, n: int) -> None:
        extra = n - self.size
        self.blocks += [None] * extra
        for lst, v in ((self.hits, 0), (self.lineage, 0), (self.depth, 0), (self.rel, 0), (self.seq, 0), (self.cls, 0),
                       (self.gen, 0), (self.plink, -1), (self.pgen, 0), (self.counted, -1),
                       (self.nfree_child, 0), (self.leaf_pos, -1)):
            lst += [v] * extra  # type: ignore[operator]
        super()._grow(n)
        self.gran = max(1, n // 32)
        self.refresh_every = max(64, n // 8)
        self.decay = 0.5 ** (self.refresh_every / (self.HALF_LIFE_POOLS * n))
        self.ghost_cap = self.GHOST_POOLS * n
        self.window = int(self.WINDOW_POOLS * n)

    @property
    def num_free_blocks(self) -> int:  # type: ignore[override]
        return self.empty.num_free_blocks + self.low.num_free_blocks + self._num_main

    # -- the leaf set ---------------------------------------------------------------------------------

    def _add_leaf(self, bid: int) -> None:
        self.leaf_pos[bid] = len(self.leaves)
        self.leaves.append(bid)

    def _drop_leaf(self, bid: int) -> None:
        i = self.leaf_pos[bid]
        last = self.leaves.pop()
        if last != bid:
            self.leaves[i] = last
            self.leaf_pos[last] = i
        self.leaf_pos[bid] = -1

    def _counted_parent(self, bid: int) -> int:
        """The parent whose free-child count includes `bid` now (-1: none, or a stale link to a parent
        handed out for other content since)."""
        p = self.counted[bid]
        return p if p >= 0 and self.pgen[bid] == self.gen[p] else -1

    def _leave_main(self, bid: int) -> None:
        """`bid` is no longer a free cached candidate (taken by a hit or evicted)."""
        if self.leaf_pos[bid] >= 0:
            self._drop_leaf(bid)
        p = self._counted_parent(bid)
        self.counted[bid] = -1
        if p >= 0:
            self.nfree_child[p] -= 1
            if self.nfree_child[p] == 0 and self.where[p] == _MAIN:
                self._add_leaf(p)  # its last free child went: the parent is a candidate now
        self._num_main -= 1

    # -- the contract ---------------------------------------------------------------------------------

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        self.ensure(blocks)
        # The lineage of the chain released together (its deepest blocks, the request's own) classes
        # every block in it: the blocks of one chain come back together (a conversation's next turn
        # hits all of them), whatever their own depth.
        lineage = self.lineage
        lin = max(lineage[b.block_id] for b in blocks)
        now, where, gen = self.now, self.where, self.gen
        for b in blocks:
            bid = b.block_id
            self.blocks[bid] = b
            self.cls[bid] = _class(self.hits[bid], lin)
            self.rel[bid] = now
            self._seq += 1
            self.seq[bid] = self._seq
            where[bid] = _MAIN
            p = self.plink[bid]
            if p >= 0 and self.pgen[bid] == gen[p]:
                self.counted[bid] = p
                self.nfree_child[p] += 1
                if self.leaf_pos[p] >= 0:
                    self._drop_leaf(p)
            if self.nfree_child[bid] == 0:
                self._add_leaf(bid)
        self._num_main += len(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        w = self.where[bid] if bid < self.size else _NONE
        if w == _NONE:
            raise ValueError(f"block {bid} is not free")
        if w == _MAIN:
            self._leave_main(bid)
        else:
            (self.empty if w == _EMPTY else self.low).remove(block)
        self.where[bid] = _NONE

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        out = self._take_n(n, self._evict)
        for blk in out:
            self._handed_out(blk)
        return out

    def _handed_out(self, blk: KVCacheBlock) -> None:
        """`blk` leaves the pool to hold other content: links from its children go stale, and so do
        their counts; the policy's clock (allocations) moves on."""
        if blk.block_id < self.size:
            self.gen[blk.block_id] += 1
            self.nfree_child[blk.block_id] = 0
        self.now += 1

    def handed_out_elsewhere(self, blk: KVCacheBlock) -> None:
        """For a policy that combines this one with others (`kvpool.core.adaptive`): `blk` was handed out
        by the combination, not by `popleft_n`. A cached candidate here (another policy chose it as the
        victim) counts as evicted, as if this policy had chosen it: its ghost, its observation window
        and its histograms learn from every eviction, whoever made it. Any other block (empty or low
        value: the combination keeps those queues) only moves the clock."""
        bid = blk.block_id
        if bid < self.size and self.where[bid] == _MAIN:
            self._evicted(bid)
            self.where[bid] = _NONE
        self._handed_out(blk)

    def _evict(self) -> KVCacheBlock:
        best = self._choose()
        self._evicted(best)
        blk = self.blocks[best]
        assert blk is not None
        return blk

    def _choose(self) -> int:
        """The leaf to evict: the lowest density of up to SAMPLES sampled leaves, ties to the oldest release."""
        leaves, dens, rel, cls = self.leaves, self.dens, self.rel, self.cls
        now, gran, top = self.now, self.gran, _N_AGE - 1
        k = len(leaves)
        if k <= self.SAMPLES:
            cand: Sequence[int] = leaves
        else:
            rnd = self.rng.random
            cand = [leaves[int(rnd() * k)] for _ in range(self.SAMPLES)]
        seq = self.seq
        best = -1
        best_d = 0.0
        best_s = 0
        for bid in cand:
            a = (now - rel[bid]) // gran
            d = dens[cls[bid] * _N_AGE + (a if a < top else top)]
            if best < 0 or d < best_d or (d == best_d and seq[bid] < best_s):
                best, best_d, best_s = bid, d, seq[bid]
        return best

    def _evicted(self, best: int) -> None:
        """Block `best`, a free cached candidate, is evicted: out of the leaf structure, its hash into the
        ghost list and its event into the observation window (or, without a hash, straight into the
        histograms)."""
        cls, rel, now, gran, top = self.cls, self.rel, self.now, self.gran, _N_AGE - 1
        self._leave_main(best)
        blk = self.blocks[best]
        assert blk is not None
        h = blk.block_hash
        if h is not None:
            ghosts = self.ghosts
            ghosts.pop(h, None)
            ghosts[h] = (self.hits[best], self.lineage[best])
            if len(ghosts) > self.ghost_cap:
                ghosts.popitem(last=False)
            pend = self.pending
            old = pend.pop(h, None)
            if old is not None:  # a duplicate copy evicted twice in a window: settle the first now
                self._censor(old)
            pend[h] = (cls[best], rel[best], now)
        else:
            a = (now - rel[best]) // gran
            self.h_evict[cls[best] * _N_AGE + (a if a < top else top)] += 1.0
        self._settle()
        self._since_refresh += 1
        if self._since_refresh >= self.refresh_every:
            self._refresh()

    def _censor(self, ev: tuple[int, int, int]) -> None:
        c, rel, t_ev = ev
        a = (t_ev + self.window - rel) // self.gran
        self.h_evict[c * _N_AGE + (a if a < _N_AGE - 1 else _N_AGE - 1)] += 1.0

    def _settle(self) -> None:
        """Evictions older than the window that did not come back: an eviction event at the age the
        block would have reached had it been kept `window` longer. Together with the returns counted
        as hits, this is an exact observation of every evicted block for `window` more allocations
        (a hit at its age, or survival to the window's end): no hit is counted without the exposure
        that led to it (counting returns alone would make old ages look ever more valuable)."""
        pend = self.pending
        limit = self.now - self.window
        while pend:
            h = next(iter(pend))
            ev = pend[h]
            if ev[2] > limit:
                break
            del pend[h]
            self._censor(ev)

    def _refresh(self) -> None:
        """Recompute the density table from the histograms, then decay them."""
        self._since_refresh = 0
        h_hit, h_ev = self.h_hit, self.h_evict
        rows = range(0, _N_CLASS * _N_AGE, _N_AGE)
        # Shrinkage: every class gets PRIOR events shaped like the whole pool's.
        g_hit = [sum(col) for col in zip(*(h_hit[b:b + _N_AGE] for b in rows), strict=True)]
        g_ev = [sum(col) for col in zip(*(h_ev[b:b + _N_AGE] for b in rows), strict=True)]
        g_n = sum(g_hit) + sum(g_ev)
        k = self.PRIOR / g_n if g_n > 0 else 0.0
        p_hit, p_ev = [k * x for x in g_hit], [k * x for x in g_ev]
        # From the oldest age down: hits at or above each age, and the expected remaining lifetime
        # summed over the events at or above it (an event at age x leaves x - a + 1 bins of life).
        def density(hit: list[float], ev: list[float]) -> list[float]:
            hit = [x + p for x, p in zip(hit, p_hit, strict=True)]
            events = [x + e + p for x, e, p in zip(hit, ev, p_ev, strict=True)]
            hits_up = list(accumulate(reversed(hit)))
            life_up = list(accumulate(accumulate(reversed(events))))
            return [h / life if life > 0 else 0.0 for h, life in zip(hits_up, life_up, strict=True)][::-1]

        dens = self.dens
        prior_only: list[float] | None = None  # the row of every class that has seen nothing yet
        for b in rows:
            hit, ev = h_hit[b:b + _N_AGE], h_ev[b:b + _N_AGE]
            if any(hit) or any(ev):
                dens[b:b + _N_AGE] = density(hit, ev)
            else:
                prior_only = prior_only or density(hit, ev)
                dens[b:b + _N_AGE] = prior_only
        f = self.decay
        self.h_hit = [x * f for x in h_hit]
        self.h_evict = [x * f for x in h_ev]

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Empty, then low, then cached blocks from the lowest density (a full ranking, for tests: the
        leaves' order is exact; a parent is listed right after its last free child)."""
        yield from self.empty
        yield from self.low
        # Replay the evictions on a copy of the leaf structure, without sampling (the exact order).
        nfree = list(self.nfree_child)
        now, gran, top = self.now, self.gran, _N_AGE - 1
        dens, rel, cls, seq = self.dens, self.rel, self.cls, self.seq

        def key(bid: int) -> tuple[float, int, int]:
            a = (now - rel[bid]) // gran
            return dens[cls[bid] * _N_AGE + (a if a < top else top)], seq[bid], bid

        heap = [key(b) for b in self.leaves]
        heapq.heapify(heap)
        while heap:
            bid = heapq.heappop(heap)[2]
            yield self.blocks[bid]  # type: ignore[misc]
            p = self._counted_parent(bid)
            if p >= 0:
                nfree[p] -= 1
                if nfree[p] == 0 and self.where[p] == _MAIN:
                    heapq.heappush(heap, key(p))

    def check(self) -> None:
        """Integrity of the leaf structure (tests): counts, positions, every main block reachable."""
        main = [i for i in range(self.size) if self.where[i] == _MAIN]
        assert len(main) == self._num_main, "main count drifted"
        n_child = [0] * self.size
        for j in main:
            p = self._counted_parent(j)
            if p >= 0:
                n_child[p] += 1
        assert n_child == self.nfree_child, "free-child counts drifted"
        for i in range(self.size):
            is_leaf = self.where[i] == _MAIN and self.nfree_child[i] == 0
            assert (self.leaf_pos[i] >= 0) == is_leaf, f"leaf set wrong at block {i}"
            if is_leaf:
                assert self.leaves[self.leaf_pos[i]] == i
        assert len(self.leaves) == sum(1 for p in self.leaf_pos if p >= 0)
        # Every free block is reached from the leaves (blocks waiting on each other never would be).
        assert sum(1 for _ in self) == self.num_free_blocks, "a free block is unreachable from the leaves"

    # -- observations ---------------------------------------------------------------------------------

    def on_touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        self.ensure(blocks)
        now, gran, top = self.now, self.gran, _N_AGE - 1
        where, hits = self.where, self.hits
        for b in blocks:
            if b.block_hash is None:
                continue
            bid = b.block_id
            if where[bid] == _MAIN:
                # A hit on a candidate: at the age it had reached (blocks in use were no candidates).
                a = (now - self.rel[bid]) // gran
                self.h_hit[self.cls[bid] * _N_AGE + (a if a < top else top)] += 1.0
            elif b.ref_cnt > 0:
                # Shared by a request in flight: a hit at age 0 (it has not been a candidate since).
                self.h_hit[self.cls[bid] * _N_AGE] += 1.0
            hits[bid] += 1

    def on_cached(self, block: KVCacheBlock, index: int, parent: KVCacheBlock | None) -> None:
        self.ensure((block,) if parent is None else (block, parent))
        bid = block.block_id
        h = block.block_hash
        ghost = self.ghosts.pop(h, None) if h is not None else None
        if parent is not None and parent.block_hash is not None:
            pid = parent.block_id
            self.plink[bid] = pid
            self.pgen[bid] = self.gen[pid]
            # A block past a prefix that was hit (and not this chain's own recomputation): a later
            # request extended that prefix, one more step of lineage.
            lin = self.lineage[pid] + (1 if self.hits[pid] and ghost is None else 0)
        else:
            self.plink[bid] = -1
            lin = 0
        if ghost is not None:
            # Computed again after its eviction: a block that is reused (its old lineage stands).
            hits, lin = ghost
            self.hits[bid] = hits + 1
            ev = self.pending.pop(h, None) if h is not None else None
            if ev is not None:
                # Within the window: keeping it would have given a hit at this age.
                a = (self.now - ev[1]) // self.gran
                self.h_hit[ev[0] * _N_AGE + (a if a < _N_AGE - 1 else _N_AGE - 1)] += 1.0
        else:
            self.hits[bid] = 0
        self.lineage[bid] = lin
        self.depth[bid] = index

    def on_uncached(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if bid < self.size:
            self.hits[bid] = 0
            self.lineage[bid] = 0


register_policy("lhd", LHDPolicy)
