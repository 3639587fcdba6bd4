"""The router's view of what each replica caches: block hash -> replicas (and tiers) holding it.

Two sources, one per kind of replica:
- `PrefixIndex`, fed by a replica's KV events (vLLM's wire format, `kvpool.server.kv_events`). Stored and
  removed are counted per (replica, tier, layer group, hash), so a stream that reports every copy (vLLM's
  shape) and one that reports only the first and last copy (kvpool's older shape) both end at the right set.
  For a replica whose groups' hit rules are known (a kvpool replica says them on /health), a match is the
  longest prefix every group serves (`kvpool.core.hit_rules`): a hybrid model's window or state blocks
  evicted before its full-attention chain end the hit there; otherwise a hash held by any group counts.
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvpool.core.hit_rules import GroupRule, longest_servable

STORE = "*store*"
# ~600 bytes of index per hash: the store's part of the index stays under ~300 MB.
DEFAULT_MAX_STORE_BLOCKS = 500_000
TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}


class PrefixIndex:
    def __init__(self, max_store_blocks: int = DEFAULT_MAX_STORE_BLOCKS) -> None:
        if max_store_blocks < 1:
            raise ValueError(f"max_store_blocks: must be >= 1, got {max_store_blocks}")
        self._lock = threading.Lock()
        # hash -> replica -> Counter((tier, group) -> copies)
        self._blocks: dict[bytes, dict[str, Counter[tuple[str, int]]]] = {}
        self._by_replica: dict[str, set[bytes]] = {}
        self.max_store_blocks = max_store_blocks
        # the store's (hash, group) entries, least recently stored first
        self._store_order: OrderedDict[tuple[bytes, int], None] = OrderedDict()
        self.events_applied = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def num_blocks(self, replica: str) -> int:
        return len(self._by_replica.get(replica, ()))

    def apply(self, replica: str, events: Iterable[dict[str, Any]]) -> None:
        """Apply one batch of decoded events (dicts with a "type") from `replica`, whole or not at all: a
        ValueError names the first malformed field, and nothing of the batch is applied."""
        # (type, owner, hashes, tier, group); a removal naming no group removes a copy in whichever group holds
        # one (a stream may carry group_idx on some events only: the field is optional in vLLM's classes)
        ops: list[tuple[str, str, list[bytes], str, int | None]] = []
        for e in events:
            kind = e.get("type")
            if kind in ("BlockStored", "BlockRemoved"):
                tier = e.get("medium") or "GPU"
                if not isinstance(tier, str):
                    raise ValueError(f"medium: must be a string, got {type(tier).__name__}")
                hashes = e.get("block_hashes")
                if not isinstance(hashes, list | tuple):
                    raise ValueError(f"block_hashes: must be a list, got {type(hashes).__name__}")
                group = e.get("group_idx")
                if group is None and kind == "BlockStored":
                    group = 0
                if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group < 0):
                    raise ValueError(f"group_idx: must be an int >= 0, got {group!r}")
                ops.append((kind, STORE if tier == "STORAGE" else replica, [_key(h) for h in hashes], tier, group))
            elif kind == "AllBlocksCleared":
                ops.append((kind, replica, [], "", 0))
            else:
                ops.append(("", replica, [], "", 0))  # a kind this router does not use
        with self._lock:
            for kind, owner, hashes, tier, group in ops:
                if kind == "BlockStored":
                    for h in hashes:
                        self._add(owner, h, tier, group or 0)
                elif kind == "BlockRemoved":
                    for h in hashes:
                        self._remove(owner, h, tier, group)
                elif kind == "AllBlocksCleared":
                    self._clear(replica)
                self.events_applied += 1

    def clear(self, replica: str) -> None:
        """Forget a replica's blocks (it restarted, or its stream broke and cannot be replayed)."""
        with self._lock:
            self._clear(replica)

    def _add(self, replica: str, h: bytes, tier: str, group: int = 0) -> None:
        if replica == STORE:
            # One copy per hash and group: a store holds a key once however many replicas wrote it, and
            # removes it without an event, so counting writes would keep it here forever.
            self._store_order[h, group] = None
            self._store_order.move_to_end((h, group))
            self._blocks.setdefault(h, {}).setdefault(STORE, Counter())[tier, group] = 1
            self._by_replica.setdefault(STORE, set()).add(h)
            if len(self._store_order) > self.max_store_blocks:
                (old, old_group), _ = self._store_order.popitem(last=False)
                self._uncount(STORE, old, lambda key: key[1] == old_group)
            return
        self._blocks.setdefault(h, {}).setdefault(replica, Counter())[tier, group] += 1
        self._by_replica.setdefault(replica, set()).add(h)

    def _uncount(self, replica: str, h: bytes, which: Callable[[tuple[str, int]], bool]) -> None:
        """Forget `replica`'s copies of `h` whose (tier, group) `which` names; the hash goes once none is left."""
        holders = self._blocks.get(h)
        copies = holders.get(replica) if holders is not None else None
        if copies is None:
            return
        for key in [k for k in copies if which(k)]:
            del copies[key]
        if not copies:
            del holders[replica]  # type: ignore[union-attr]
            self._by_replica[replica].discard(h)
            if not holders:
                del self._blocks[h]

    def _remove(self, replica: str, h: bytes, tier: str, group: int | None = 0) -> None:
        holders = self._blocks.get(h)
        if holders is None or replica not in holders:
            return
        copies = holders[replica]
        if replica == STORE:
            for g in [g for _, g in copies if group is None or g == group]:
                self._store_order.pop((h, g), None)
            self._uncount(STORE, h, lambda key: group is None or key[1] == group)
            return
        if group is None:  # the copy of group 0 if there is one, else the lowest group's in this tier
            held = sorted(g for t, g in copies if t == tier)
            if not held:
                return
            group = 0 if 0 in held else held[0]
        copies[tier, group] -= 1
        if copies[tier, group] <= 0:
            self._uncount(replica, h, lambda key: key == (tier, group))

    def _clear(self, replica: str) -> None:
        for h in self._by_replica.pop(replica, set()):
            holders = self._blocks.get(h)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self._blocks[h]

    def match(self, hashes: Sequence[bytes], replicas: Sequence[str],
              rules: Mapping[str, Sequence[GroupRule] | None] | None = None) -> dict[str, tuple[int, float]]:
        """Per replica: (blocks of the longest cached prefix, the same weighted by tier). The store's
        blocks extend every replica's prefix. `rules`: the replicas whose groups' hit rules are known (see
        the module doc); a block's weight is then its best copy in any group (1 if no group needs it)."""
        out: dict[str, tuple[int, float]] = {}
        with self._lock:
            for r in replicas:
                rule = rules.get(r) if rules else None
                # (one full-attention group, every model but a hybrid one: any group's copy is that group's)
                grouped = rule is not None and [x.kind for x in rule if x.kind != "none"] != ["full"]
                out[r] = self._match_grouped(hashes, r, rule) if grouped else self._match_any(hashes, r)  # type: ignore[arg-type]
        return out

    def _match_any(self, hashes: Sequence[bytes], r: str) -> tuple[int, float]:
        n, w = 0, 0.0
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is None:
                break
            copies = holders.get(r) or holders.get(STORE)
            if not copies:
                break
            n += 1
            w += max(TIER_WEIGHTS.get(t, 0.5) for t, _ in copies)
        return n, w

    def _match_grouped(self, hashes: Sequence[bytes], r: str, rules: Sequence[GroupRule]) -> tuple[int, float]:
        blocks = self._blocks

        seen: dict[int, list[tuple[str, int]]] = {}

        def copies(i: int) -> list[tuple[str, int]]:
            got = seen.get(i)
            if got is None:
                holders = blocks.get(hashes[i])
                got = seen[i] = [] if holders is None else [k for who in (r, STORE) for k in holders.get(who, ())]
            return got

        n = longest_servable(len(hashes), lambda g, i: any(group == g for _, group in copies(i)), rules)
        # A block some group reads is worth its best copy; one no group needs (before a window) is free.
        return n, sum(max((TIER_WEIGHTS.get(t, 0.5) for t, _ in copies(i)), default=1.0) for i in range(n))


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
