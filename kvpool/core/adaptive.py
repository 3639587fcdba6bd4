"""`adaptive`: the learned policies `reuse` and `lhd` as two experts, weighted online by their regret.

Neither learned policy wins everywhere (docs/benchmarks.md): `reuse` (the reuse probability of a
block's class) is best where first reuses come pool turnovers after release and whether a chain comes
back shows in what the system saw (the Mooncake traces); `lhd` (hit density by age) is best where
returns come within a pool and their timing is what counts (conversations whose next turn comes
soon). Which one a deployment needs depends on its traffic, which the operator rarely knows and which
changes. This policy runs both and lets the traffic decide, after LeCaR (Vietri et al., HotStorage'18),
which did the same for LRU and LFU:

- Both experts see every event (releases, hits, caching, uncaching) and keep their own ranking of the
  free cached blocks; the empty and low-value queues are kept here, in front of both (taken first, as
  with every policy).
- An eviction is made by one expert, drawn at random with probability its weight; the victim leaves
  the other expert too, and that expert learns from it as from an eviction of its own (its statistics
  follow every eviction, whoever made it).
- The victim's hash goes into a ghost list (one pool's worth of hashes) with the expert that chose it
  and the time. When a ghost hash is cached again, the eviction cost a hit: that expert's weight is
  multiplied by exp(-LEARNING_RATE * DISCOUNT ** t), t the allocations since the eviction (a mistake
  found soon weighs more than one found a pool later), and the weights are renormalized, each kept
  at least MIN_WEIGHT so that an expert that was wrong for a while can come back when the traffic
  changes.

The constants are LeCaR's own (learning rate 0.45, a discount of 0.005 over one pool of allocations, a
ghost list of one pool), not fitted to any trace here. The draw is seeded: a replay is reproducible.
Cost: both experts' bookkeeping on every event, about the sum of the two policies' costs.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvpool.core.block import BlockHash, KVCacheBlock
from kvpool.core.eviction import register_policy
from kvpool.core.lhd import LHDPolicy
from kvpool.core.policies import _EMPTY, _LOW, _NONE, ReusePolicy, _Slots


class AdaptivePolicy(_Slots):
    """`reuse` and `lhd` as experts, each eviction drawn by their regret-learned weights (module doc)."""

    name = "adaptive"
    observes = True
    LEARNING_RATE = 0.45
    DISCOUNT_PER_POOL = 0.005  # a ghost hit found one pool of allocations after its eviction weighs this
    GHOST_POOLS = 1
    MIN_WEIGHT = 0.01

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.reuse = ReusePolicy()
        self.lhd = LHDPolicy(seed)
        self.weights = [0.5, 0.5]  # reuse, lhd
        self.evictions_by = [0, 0]  # cached blocks each expert evicted
        self.regrets = [0, 0]  # ... of which came back while in the ghost list
        self.rng = random.Random(seed)
        self.now = 0  # blocks handed out
        self.ghosts: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()  # hash -> (expert, time)

    @property
    def num_free_blocks(self) -> int:  # type: ignore[override]
        return self.empty.num_free_blocks + self.low.num_free_blocks + self.reuse.num_free_blocks

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        out = []
        reuse, lhd = self.reuse, self.lhd
        for _ in range(n):
            if self.empty.num_free_blocks or self.low.num_free_blocks:
                blk = (self.empty if self.empty.num_free_blocks else self.low).popleft()
                self.where[blk.block_id] = _NONE
                lhd.handed_out_elsewhere(blk)
            else:
                expert = 0 if self.rng.random() < self.weights[0] else 1
                if expert == 0:
                    blk = reuse.popleft_n(1)[0]
                    lhd.handed_out_elsewhere(blk)
                else:
                    blk = lhd.popleft_n(1)[0]
                    reuse.remove(blk)  # (`reuse` learns of the eviction in on_uncached, whoever made it)
                self.evictions_by[expert] += 1
                h = blk.block_hash
                if h is not None:
                    ghosts = self.ghosts
                    ghosts.pop(h, None)
                    ghosts[h] = (expert, self.now)
                    while len(ghosts) > self.GHOST_POOLS * max(self.size, 1):
                        ghosts.popitem(last=False)
            self.now += 1
            out.append(blk)
        return out

    def remove(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        w = self.where[bid] if bid < self.size else _NONE
        if w in (_EMPTY, _LOW):
            (self.empty if w == _EMPTY else self.low).remove(block)
            self.where[bid] = _NONE
        else:
            self.reuse.remove(block)  # (raises for a block that is not free)
            self.lhd.remove(block)

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if blocks:
            self.ensure(blocks)
            self.reuse.append_n(blocks)
            self.lhd.append_n(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Empty, then low-value, then cached blocks in `reuse`'s order (the draw decides the real one)."""
        yield from self.empty
        yield from self.low
        yield from self.reuse

    def check(self) -> None:
        """Both experts hold the same free cached blocks (tests)."""
        self.lhd.check()
        a, b = ({x.block_id for x in e} for e in (self.reuse, self.lhd))
        assert a == b, f"the experts' free blocks differ: {sorted(a ^ b)}"
        assert not (a & {x.block_id for x in self.empty}) and not (a & {x.block_id for x in self.low})

    # -- observations: to both experts; a ghost hit is a regret of the expert that evicted it ---------

    def on_touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.reuse.on_touch(blocks)
        self.lhd.on_touch(blocks)

    def on_cached(self, block: KVCacheBlock, index: int, parent: KVCacheBlock | None) -> None:
        h = block.block_hash
        ghost = self.ghosts.pop(h, None) if h is not None else None
        if ghost is not None:
            expert, at = ghost
            self.regrets[expert] += 1
            pool = max(self.size, 1)
            w = list(self.weights)
            w[expert] *= math.exp(-self.LEARNING_RATE * self.DISCOUNT_PER_POOL ** ((self.now - at) / pool))
            p = min(max(w[0] / (w[0] + w[1]), self.MIN_WEIGHT), 1.0 - self.MIN_WEIGHT)
            self.weights = [p, 1.0 - p]
        self.reuse.on_cached(block, index, parent)
        self.lhd.on_cached(block, index, parent)

    def on_uncached(self, block: KVCacheBlock) -> None:
        self.reuse.on_uncached(block)
        self.lhd.on_uncached(block)

    def on_release(self, num_output_tokens: int | None) -> None:
        self.reuse.on_release(num_output_tokens)
        self.lhd.on_release(num_output_tokens)


register_policy("adaptive", AdaptivePolicy)
