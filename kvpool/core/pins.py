"""Pinned prefixes: cached blocks a user asked to keep on the device for a while (a system prompt).

A pin holds one reference on each block of the prefix's full blocks, as a running request does: a
block with a reference is never free, so no eviction policy can take it, and when the pin goes (its
TTL passed, or `unpin`) the blocks are released in chain order, tail first, to the policy like any
finished request's blocks. Holding references rather than teaching every policy to skip blocks keeps
the policies' contract as it is and makes a pin exact: these block ids, until the pin ends.

Pins live within a budget of blocks (by default 20% of the pool): a pin that would exceed it is
refused whole, never partially, with a ValueError that says how much room is left. A block shared by
two pins counts once. Re-pinning the same prefix (same hashes: same tokens and cache salt) refreshes
its TTL. Time comes from the caller (`now`): the core does no I/O and reads no clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.block import BlockHash, KVCacheBlock
from kvpool.core.block_pool import BlockPool

DEFAULT_PIN_BUDGET = 0.2  # fraction of the pool's usable blocks that pins may hold


class PrefixNotCached(ValueError):
    """Some block of the prefix is not in the device cache (compute it, then pin again)."""


class PinBudgetExceeded(ValueError):
    """The pin would hold more blocks than the budget allows (refused whole)."""


@dataclass
class Pin:
    pin_id: str
    hashes: tuple[BlockHash, ...]
    blocks: list[KVCacheBlock]
    expires_at: float | None  # None: until unpinned
    num_tokens: int

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class PinSet:
    """The pins of one device pool. Give `held_blocks` to `KVCacheManager.external_holders` so that
    the manager's integrity check counts the pins' references."""

    def __init__(self, pool: BlockPool, budget_blocks: int) -> None:
        if budget_blocks < 0:
            raise ValueError(f"pin budget: must be >= 0 blocks, got {budget_blocks}")
        self.pool = pool
        self.budget_blocks = budget_blocks
        self.pins: dict[str, Pin] = {}
        self._by_hashes: dict[tuple[BlockHash, ...], str] = {}
        self._held: Counter[int] = Counter()  # block id -> pins holding it
        self._expiry: list[tuple[float, int, str]] = []  # (expires_at, version, pin id), lazily cleaned
        self._version = itertools.count()
        self._ids = itertools.count(1)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._held)

    def __len__(self) -> int:
        return len(self.pins)

    def held_blocks(self) -> list[KVCacheBlock]:
        """Every reference the pins hold (a block once per pin holding it): for integrity checks."""
        return [b for pin in self.pins.values() for b in pin.blocks]

    def pin(self, hashes: Sequence[BlockHash], *, now: float, ttl: float | None, num_tokens: int = 0) -> Pin:
        """Pin the cached blocks holding `hashes` (a chain, head first) until `now + ttl`.

        Raises PrefixNotCached if any of them is not cached, ValueError if the pin would exceed the
        budget; either way nothing changes."""
        if ttl is not None:
            # NaN would sit at the top of the expiry heap forever (no comparison is true) and stop every
            # later pin from expiring; a string would fail deep in the heap.
            if isinstance(ttl, bool) or not isinstance(ttl, int | float) or math.isnan(ttl) or ttl <= 0:
                raise ValueError(f"ttl: must be a number of seconds > 0 (or None: until unpinned), got {ttl!r}")
            if math.isinf(ttl):
                ttl = None
        if not hashes:
            raise ValueError("pin_prefix: the prefix holds no full block; nothing to pin")
        self.expire(now)
        key = tuple(hashes)
        expires_at = None if ttl is None else now + ttl
        existing = self._by_hashes.get(key)
        if existing is not None:  # the same prefix again: a new TTL, the same blocks
            pin = self.pins[existing]
            pin.expires_at = expires_at
            self._schedule(pin)
            return pin
        # The budget first (by hash: a pinned block keeps its hash), so that a refused pin costs no
        # computation of the prefix.
        pinned = {b.block_hash for pin in self.pins.values() for b in pin.blocks}
        new = len(set(key) - pinned)
        if self.num_pinned_blocks + new > self.budget_blocks:
            raise PinBudgetExceeded(
                f"pin_prefix: {new} more blocks would exceed the pin budget of {self.budget_blocks} blocks "
                f"({self.num_pinned_blocks} pinned, {self.budget_blocks - self.num_pinned_blocks} left)")
        blocks = []
        for i, h in enumerate(hashes):
            blk = self.pool.get_cached_block(h)
            if blk is None:
                raise PrefixNotCached(f"pin_prefix: block {i} of {len(hashes)} of the prefix is not cached")
            blocks.append(blk)
        self.pool.touch(blocks)  # a reference each: never free, so never evicted, while pinned
        for b in blocks:
            self._held[b.block_id] += 1
        pin = Pin(f"pin-{next(self._ids)}", key, blocks, expires_at, num_tokens)
        self.pins[pin.pin_id] = pin
        self._by_hashes[key] = pin.pin_id
        self._schedule(pin)
        return pin

    def _schedule(self, pin: Pin) -> None:
        if pin.expires_at is not None:
            heapq.heappush(self._expiry, (pin.expires_at, next(self._version), pin.pin_id))

    def unpin(self, pin_id: str) -> bool:
        """Release a pin's blocks to the eviction policy (tail first). False if no such pin."""
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        del self._by_hashes[pin.hashes]
        for b in pin.blocks:
            self._held[b.block_id] -= 1
            if not self._held[b.block_id]:
                del self._held[b.block_id]
        self.pool.free_blocks(reversed(pin.blocks))
        return True

    def expire(self, now: float) -> list[str]:
        """Release the pins whose TTL has passed; their ids."""
        gone = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            at, _, pin_id = heapq.heappop(heap)
            pin = self.pins.get(pin_id)
            if pin is not None and pin.expires_at == at:  # else unpinned, or its TTL was refreshed
                self.unpin(pin_id)
                gone.append(pin_id)
        return gone

    def clear(self) -> None:
        for pin_id in list(self.pins):
            self.unpin(pin_id)
