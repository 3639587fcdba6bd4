"""Eviction policies: the order in which a pool reuses its free blocks, as a strategy plugged into it.

A pool owns its blocks, ref counts and hash map; which free block (ref_cnt 0) is taken next is the
policy's business alone. The pool tells the policy what happens to blocks through the `EvictionPolicy`
contract: a block becomes free holding cached content (`append_n`, in the order the caller wants them
evicted among themselves), becomes free holding nothing (`prepend_n`: reused before any cached block),
becomes free holding content no later hit is likely to use (`append_low_n`: a sliding window's blocks
outside every window that matters; evicted after the empty blocks, before any other cached block), is
taken back by a prefix hit while free (`remove`), and the pool asks for victims (`popleft_n`).
Policies that learn from traffic also get the observation hooks (`on_touch`, `on_cached`,
`on_uncached`, and `on_release`: what the manager knows of the request whose blocks come next); a
policy that does not need them sets `observes = False` and the pool skips the calls on its hot paths.

`LRUPolicy` is the seeds' order (the free queue itself): least recently freed first, the tail of a
chain before its head, blocks without cached content before any cached block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from kvpool.core.block import KVCacheBlock
from kvpool.core.free_queue import FreeBlockQueue


@runtime_checkable
class EvictionPolicy(Protocol):
    """What a pool asks of its eviction policy. Every method is O(1) or O(log n) per block."""

    name: str
    # Whether the pool must call the observation hooks (False: LRU, which needs none of them).
    observes: bool

    @property
    def num_free_blocks(self) -> int: ...

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the next `n` victims out of the policy (the pool uncaches and hands them out)."""
        ...

    def remove(self, block: KVCacheBlock) -> None:
        """A free block was taken back (a prefix hit): it is no longer a candidate."""
        ...

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Blocks became free holding cached content; the first given is evicted first among them."""
        ...

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Blocks became free holding nothing worth keeping: reused before any cached block, the first
        given first."""
        ...

    def append_low_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Blocks became free holding content a later hit is unlikely to use: evicted after the empty
        blocks and before every other cached block, the first given first."""
        ...

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order (next victim first); for tests and integrity checks."""
        ...

    def on_touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix hit took these blocks (free or already in use): an access."""
        ...

    def on_cached(self, block: KVCacheBlock, index: int, parent: KVCacheBlock | None) -> None:
        """`block` now holds the hash of block `index` of a chain whose previous block is `parent`."""
        ...

    def on_uncached(self, block: KVCacheBlock) -> None:
        """`block` lost its hash (evicted, or the cache was reset)."""
        ...

    def on_release(self, num_output_tokens: int | None) -> None:
        """The blocks released next (until the next call) come from a request that finished after
        generating `num_output_tokens` tokens (None: not known, or a preempted request that will
        resume)."""
        ...


class NoObservations:
    """The observation hooks as no-ops, for a policy that does not learn from them (or learns from some)."""

    def on_touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        pass

    def on_cached(self, block: KVCacheBlock, index: int, parent: KVCacheBlock | None) -> None:
        pass

    def on_uncached(self, block: KVCacheBlock) -> None:
        pass

    def on_release(self, num_output_tokens: int | None) -> None:
        pass


class LRUPolicy(NoObservations, FreeBlockQueue):
    """Least recently used: the free queue's own order (see `kvpool.core.free_queue`), plus a queue of
    low-value blocks (`append_low_n`) taken once the empty blocks at the queue's head are gone."""

    name = "lru"
    observes = False

    def __init__(self) -> None:
        super().__init__()
        self.low = FreeBlockQueue()
        self._low_ids: set[int] = set()

    def append_low_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        for b in blocks:
            self.low.append(b)
            self._low_ids.add(b.block_id)
            self.num_free_blocks += 1

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if not self._low_ids:
            return super().popleft_n(n)  # the common case: one queue, one batch
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self._pop_one() for _ in range(n)]

    def popleft(self) -> KVCacheBlock:
        return self._pop_one() if self._low_ids else super().popleft()

    def _pop_one(self) -> KVCacheBlock:
        head = self._head.next_free
        if self.low.num_free_blocks and (head is self._tail or head.block_hash is not None):  # type: ignore[union-attr]
            blk = self.low.popleft()
            self._low_ids.discard(blk.block_id)
            self.num_free_blocks -= 1
            return blk
        return super().popleft()

    def remove(self, block: KVCacheBlock) -> None:
        if block.block_id in self._low_ids:
            self.low.remove(block)
            self._low_ids.discard(block.block_id)
            self.num_free_blocks -= 1
        else:
            super().remove(block)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        main = super().__iter__()
        pending = None
        for b in main:
            if b.block_hash is not None:
                pending = b
                break
            yield b
        yield from self.low
        if pending is not None:
            yield pending
            yield from main

    def __contains__(self, block: object) -> bool:
        return super().__contains__(block) or (isinstance(block, KVCacheBlock) and block.block_id in self._low_ids)


PolicyFactory = Callable[[], EvictionPolicy]

# Device-tier policies by name; later policies register here (`register_policy`).
_POLICIES: dict[str, PolicyFactory] = {"lru": LRUPolicy}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make a policy selectable by name (`--eviction-policy NAME`)."""
    _POLICIES[name] = factory


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str | EvictionPolicy | None, field: str = "eviction_policy") -> EvictionPolicy:
    """A fresh policy by name (None: LRU), or the given instance."""
    if name is None:
        return LRUPolicy()
    if not isinstance(name, str):
        if not isinstance(name, EvictionPolicy):
            raise ValueError(f"{field}: a policy name (one of {policy_names()}) or an EvictionPolicy, got {name!r}")
        return name
    factory = _POLICIES.get(name)
    if factory is None:
        raise ValueError(f"{field}: {name!r} is not one of {policy_names()}")
    return factory()


# The policies beyond LRU register themselves (imported last: they build on this module).
import kvpool.core.adaptive  # noqa: E402
import kvpool.core.lhd  # noqa: E402
import kvpool.core.policies  # noqa: E402, F401
