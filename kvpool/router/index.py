"""The router's view of what each replica caches: block hash -> replicas (and tiers) holding it.

Two sources, one per kind of replica:
- `PrefixIndex`, fed by a replica's KV events (vLLM's wire format, `kvpool.server.kv_events`). Stored and
  removed are counted per (replica, tier, hash), so a stream that reports every copy (vLLM's shape) and one
  that reports only the first and last copy (kvpool's older shape) both end at the right set.
- `RoutedIndex`, the approximate index: the hashes of the requests the router itself sent to a replica,
  remembered for a while. It is the whole picture for a replica that publishes no events, and for a
  replica that does it covers the gap between routing a request and its BlockStored arriving (so a burst
  of requests sharing a new prefix sees where the first one went).

Tier weights say how much a cached block is worth compared with computing it: a device hit costs nothing,
a host hit a copy, a store hit a fetch. All replicas reach a shared store, so store entries are indexed
under the pseudo-replica `STORE` and count for every replica. A store evicts without telling anyone (no
`BlockRemoved` comes for it), so the index remembers at most `max_store_blocks` of its hashes, the least
recently stored forgotten first (the order a store under an LRU bound evicts them in).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

STORE = "*store*"
# ~600 bytes of index per hash: the store's part of the index stays under ~300 MB.
DEFAULT_MAX_STORE_BLOCKS = 500_000
TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}


class PrefixIndex:
    def __init__(self, max_store_blocks: int = DEFAULT_MAX_STORE_BLOCKS) -> None:
        if max_store_blocks < 1:
            raise ValueError(f"max_store_blocks: must be >= 1, got {max_store_blocks}")
        self._lock = threading.Lock()
        # hash -> replica -> Counter(tier -> copies)
        self._blocks: dict[bytes, dict[str, Counter[str]]] = {}
        self._by_replica: dict[str, set[bytes]] = {}
        self.max_store_blocks = max_store_blocks
        self._store_order: OrderedDict[bytes, None] = OrderedDict()  # the store's hashes, least recent first
        self.events_applied = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def num_blocks(self, replica: str) -> int:
        return len(self._by_replica.get(replica, ()))

    def apply(self, replica: str, events: Iterable[dict[str, Any]]) -> None:
        """Apply one batch of decoded events (dicts with a "type") from `replica`, whole or not at all: a
        ValueError names the first malformed field, and nothing of the batch is applied."""
        ops: list[tuple[str, str, list[bytes], str]] = []  # (type, owner, hashes, tier)
        for e in events:
            kind = e.get("type")
            if kind in ("BlockStored", "BlockRemoved"):
                tier = e.get("medium") or "GPU"
                if not isinstance(tier, str):
                    raise ValueError(f"medium: must be a string, got {type(tier).__name__}")
                hashes = e.get("block_hashes")
                if not isinstance(hashes, list | tuple):
                    raise ValueError(f"block_hashes: must be a list, got {type(hashes).__name__}")
                ops.append((kind, STORE if tier == "STORAGE" else replica, [_key(h) for h in hashes], tier))
            elif kind == "AllBlocksCleared":
                ops.append((kind, replica, [], ""))
            else:
                ops.append(("", replica, [], ""))  # a kind this router does not use
        with self._lock:
            for kind, owner, hashes, tier in ops:
                if kind == "BlockStored":
                    for h in hashes:
                        self._add(owner, h, tier)
                elif kind == "BlockRemoved":
                    for h in hashes:
                        self._remove(owner, h, tier)
                elif kind == "AllBlocksCleared":
                    self._clear(replica)
                self.events_applied += 1

    def clear(self, replica: str) -> None:
        """Forget a replica's blocks (it restarted, or its stream broke and cannot be replayed)."""
        with self._lock:
            self._clear(replica)

    def _add(self, replica: str, h: bytes, tier: str) -> None:
        if replica == STORE:
            # One copy per hash: a store holds a key once however many replicas wrote it, and removes it
            # without an event, so counting writes would keep it here forever.
            self._store_order[h] = None
            self._store_order.move_to_end(h)
            self._blocks.setdefault(h, {})[STORE] = Counter({tier: 1})
            self._by_replica.setdefault(STORE, set()).add(h)
            if len(self._store_order) > self.max_store_blocks:
                old, _ = self._store_order.popitem(last=False)
                self._drop(STORE, old)
            return
        self._blocks.setdefault(h, {}).setdefault(replica, Counter())[tier] += 1
        self._by_replica.setdefault(replica, set()).add(h)

    def _drop(self, replica: str, h: bytes) -> None:
        """`replica` holds `h` no more, in any tier."""
        holders = self._blocks.get(h)
        if holders is not None and holders.pop(replica, None) is not None:
            self._by_replica[replica].discard(h)
            if not holders:
                del self._blocks[h]

    def _remove(self, replica: str, h: bytes, tier: str) -> None:
        holders = self._blocks.get(h)
        if holders is None or replica not in holders:
            return
        if replica == STORE:
            self._store_order.pop(h, None)
            self._drop(STORE, h)
            return
        tiers = holders[replica]
        tiers[tier] -= 1
        if tiers[tier] <= 0:
            del tiers[tier]
        if not tiers:
            self._drop(replica, h)

    def _clear(self, replica: str) -> None:
        for h in self._by_replica.pop(replica, set()):
            holders = self._blocks.get(h)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self._blocks[h]

    def match(self, hashes: Sequence[bytes], replicas: Sequence[str]) -> dict[str, tuple[int, float]]:
        """Per replica: (blocks of the longest cached prefix, the same weighted by tier). The store's
        blocks extend every replica's prefix."""
        out: dict[str, tuple[int, float]] = {}
        with self._lock:
            blocks = self._blocks
            for r in replicas:
                n, w = 0, 0.0
                for h in hashes:
                    holders = blocks.get(h)
                    if holders is None:
                        break
                    tiers = holders.get(r) or holders.get(STORE)
                    if not tiers:
                        break
                    n += 1
                    w += max(TIER_WEIGHTS.get(t, 0.5) for t in tiers)
                out[r] = (n, w)
        return out


class RoutedIndex:
    """Hashes the router sent to each replica, each remembered for `ttl_s` (bounded, oldest dropped)."""

    def __init__(self, ttl_s: float, max_entries: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._seen: dict[str, OrderedDict[bytes, float]] = {}

    def record(self, replica: str, hashes: Sequence[bytes], now: float | None = None) -> None:
        expiry = (time.monotonic() if now is None else now) + self.ttl_s
        with self._lock:
            od = self._seen.setdefault(replica, OrderedDict())
            for h in hashes:
                od[h] = expiry
                od.move_to_end(h)
            while len(od) > self.max_entries:
                od.popitem(last=False)

    def clear(self, replica: str) -> None:
        with self._lock:
            self._seen.pop(replica, None)

    def match(self, hashes: Sequence[bytes], replica: str, now: float | None = None) -> int:
        t = time.monotonic() if now is None else now
        n = 0
        with self._lock:
            od = self._seen.get(replica)
            if od is None:
                return 0
            for h in hashes:
                exp = od.get(h)
                if exp is None or exp < t:
                    break
                n += 1
        return n


def _key(h: Any) -> bytes:
    # vLLM's ExternalBlockHash is bytes or int; kvpool publishes bytes.
    if isinstance(h, bytes | bytearray):
        return bytes(h)
    if isinstance(h, int) and not isinstance(h, bool):
        return h.to_bytes(max(1, (h.bit_length() + 8) // 8), "big", signed=True)
    raise ValueError(f"block_hashes: a hash must be bytes or int, got {type(h).__name__}")
