"""Pinned prefixes: cached blocks a user asked to keep on the device for a while (a system prompt).

A pin holds one reference on each block of the prefix's full blocks, as a running request does: a
block with a reference is never free, so no eviction policy can take it, and when the pin goes (its
TTL passed, or `unpin`) the blocks are released in chain order, tail first, to the policy like any
finished request's blocks. Holding references rather than teaching every policy to skip blocks keeps
the policies' contract as it is and makes a pin exact: these block ids, until the pin ends.

Pins live within a budget of blocks (by default 20% of the pool): a pin that would exceed it is
refused whole, never partially, with a ValueError that says how much room is left. A block shared by
two pins counts once. Every pin is its own, even of a prefix already pinned (same tokens and cache
salt): its own id and TTL on the same blocks, ended only by its own expiry or unpin, so one caller's
short pin or unpin never cuts another's (a server's standing system-prompt pin, a client's pin of the
same prompt). Time comes from the caller (`now`): the core does no I/O and reads no clock.
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
    # What the caller needs to make the pin again once its blocks are gone (a reset of the cache): the
    # engine keeps the prefix's tokens and cache salt here. Opaque to the core.
    source: object = None

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class PinSet:
    """The pins of one device pool. Give `held_blocks` to `KVCacheManager.external_holders` so that
    the manager's integrity check counts the pins' references."""

    def __init__(self, pool: BlockPool, budget_blocks: int, id_prefix: str = "pin-") -> None:
        if budget_blocks < 0:
            raise ValueError(f"pin budget: must be >= 0 blocks, got {budget_blocks}")
        self.pool = pool
        self.budget_blocks = budget_blocks
        self.pins: dict[str, Pin] = {}
        self._held: Counter[int] = Counter()  # block id -> pins holding it
        self._expiry: list[tuple[float, str]] = []  # (expires_at, pin id), lazily cleaned
        # Ids: `id_prefix` then a count. An engine gives a prefix of its own, so that a pin id names one
        # pin of one process: a client (or a router) holding the id of a pin made before a restart must
        # not find, or delete, another pin that took the same number after it.
        self.id_prefix = id_prefix
        self._ids = itertools.count(1)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._held)

    def __len__(self) -> int:
        return len(self.pins)

    def held_blocks(self) -> list[KVCacheBlock]:
        """Every reference the pins hold (a block once per pin holding it): for integrity checks."""
        return [b for pin in self.pins.values() for b in pin.blocks]

    def pin(self, hashes: Sequence[BlockHash], *, now: float, ttl: float | None, num_tokens: int = 0,
            source: object = None, pin_id: str | None = None, expires_at: float | None = None) -> Pin:
        """Pin the cached blocks holding `hashes` (a chain, head first) until `now + ttl`, under a new id
        (or `pin_id`, an id this set issued before: a pin made again after a reset keeps the id its holder
        knows, and passes its `expires_at` as it was, for `now + (expires_at - now)` need not round back).

        Raises PrefixNotCached if any of them is not cached, ValueError if the pin would exceed the
        budget; either way nothing changes."""
        if pin_id is not None and pin_id in self.pins:
            raise ValueError(f"pin: {pin_id!r} is already pinned")
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
        if expires_at is None and ttl is not None:
            expires_at = now + ttl
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
        pin = Pin(pin_id if pin_id is not None else f"{self.id_prefix}{next(self._ids)}", key, blocks, expires_at,
                  num_tokens, source)
        self.pins[pin.pin_id] = pin
        if expires_at is not None:
            heapq.heappush(self._expiry, (expires_at, pin.pin_id))
            if len(self._expiry) > 2 * len(self.pins) + 64:  # entries of ended pins: drop them
                self._expiry = [(p.expires_at, i) for i, p in self.pins.items() if p.expires_at is not None]
                heapq.heapify(self._expiry)
        return pin

    def unpin(self, pin_id: str) -> bool:
        """Release a pin's blocks to the eviction policy (tail first). False if no such pin."""
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
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
            _, pin_id = heapq.heappop(heap)
            pin = self.pins.get(pin_id)
            # (An entry outlives its pin: unpinned before its TTL, or released and made again under the
            # same id with an expiry of its own. Only the live pin's own expiry ends it.)
            if pin is not None and pin.expires_at is not None and pin.expires_at <= now:
                self.unpin(pin_id)
                gone.append(pin_id)
        return gone

    def clear(self) -> list[Pin]:
        """Release every pin; the pins, to make again (`pin(..., pin_id=...)`) once their blocks are back."""
        gone = list(self.pins.values())
        for pin in gone:
            self.unpin(pin.pin_id)
        return gone
