"""The store tier's glue between the engine and a `StoreWorker`: what goes to the store, what comes back,
and when a waiting request may go ahead. No I/O runs on the caller's thread; the caller (the engine's step
loop) only hands over bytes it has just copied and polls futures.

Writes (write-through from the host tier): every block the step's swap plan copied device -> host is, once
the copies have run, gathered from the host tensors (a copy, so a later swap cannot change it) and queued
for the store. The store so holds everything the host tier ever sheltered, and a host eviction needs no
extra copy (and no hook in the core): it is already below.

Reads: when a request arrives, the hashes past its device + host hit are looked up in the store with one
batched read, in the background. The request is held back until the read lands or its deadline passes
(then it computes the blocks itself; a late read still lands for later requests). Two lessons from the
peers shape this:
- a read slower than recomputing must not be waited on (LMCache issue 914): `StoreStats.estimate_fetch_s`
  versus the caller's estimate of the recompute time decides whether to read at all;
- no request may wait behind another's load (vLLM issue 44294: a shared in-flight load serialised
  concurrent requests, 12x TTFT): a hash already being read is not read twice, but every request keeps its
  own deadline, so sharing a read never makes anyone wait longer than its own budget.
Landed payloads are written into host blocks (`HostBlockPool.shelter`, pinned while written, then
released), so the ordinary lookup finds them as host hits and swaps them in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvpool.store.blocks import Caches, gather, scatter
from kvpool.store.worker import StoreWorker

log = logging.getLogger(__name__)


@dataclass
class _Fetch:
    hashes: list[bytes]
    future: Future[list[bytes | None]]


@dataclass
class _Waiter:
    hashes: list[bytes]
    deadline: float


class StoreTier:
    def __init__(self, worker: StoreWorker, *, deadline_s: float = 2.0, block_bytes: int = 0,
                 recompute_s_per_block: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.worker = worker
        self.deadline_s = deadline_s
        self.block_bytes = block_bytes
        # Seconds to recompute one block, if known: reads expected to take longer are not issued.
        self.recompute_s_per_block = recompute_s_per_block
        self.clock = clock
        self._fetches: list[_Fetch] = []
        self._fetching: set[bytes] = set()
        self._waiters: dict[str, _Waiter] = {}
        self.blocks_written = 0
        self.blocks_landed = 0
        self.reads_skipped_slow = 0
        self.requests_waited = 0
        self.requests_timed_out = 0

    @property
    def stats(self) -> Any:
        return self.worker.stats

    # -- writes ---------------------------------------------------------------------------------------

    def after_swaps(self, swap_out: Sequence[tuple[int, int]], host_hash: Callable[[int], bytes | None],
                    caches: Caches) -> int:
        """Queue for the store the host blocks the swap-outs just filled; returns how many were queued."""
        ids, hashes = [], []
        for _, h in swap_out:
            key = host_hash(h)
            if key is not None:
                ids.append(h)
                hashes.append(key)
        if not ids:
            return 0
        n = self.worker.write(list(zip(hashes, gather(caches, ids), strict=True)))
        self.blocks_written += n
        return n

    # -- reads ----------------------------------------------------------------------------------------

    def request_arrived(self, request_id: str, hashes: Sequence[bytes]) -> bool:
        """Start reading `hashes` (the blocks past the request's device + host hit, in chain order).
        Returns True when the request should wait for them."""
        want = list(hashes)
        if not want or not self.worker.store.available:
            return False  # nothing to read, or the store is known down: no request waits on it
        if self.recompute_s_per_block is not None and self.block_bytes:
            est = self.stats.estimate_fetch_s(len(want) * self.block_bytes)
            if est is not None and est > self.recompute_s_per_block * len(want):
                self.reads_skipped_slow += 1
                return False
        new = [h for h in want if h not in self._fetching]
        if new:
            self._fetches.append(_Fetch(new, self.worker.fetch(new)))
            self._fetching.update(new)
        self._waiters[request_id] = _Waiter(want, self.clock() + self.deadline_s)
        self.requests_waited += 1
        return True

    def land(self, shelter: Callable[[bytes], Any], release: Callable[[list[Any]], None], caches: Caches) -> int:
        """Write every completed read into host blocks. `shelter(hash)` gives a pinned host block (or None:
        already there, or no room) and `release(blocks)` unpins them once written. Returns blocks landed."""
        landed = 0
        still: list[_Fetch] = []
        for f in self._fetches:
            if not f.future.done():
                still.append(f)
                continue
            self._fetching.difference_update(f.hashes)
            try:
                payloads = f.future.result()
            except Exception:  # the worker already logged it; a failed read is a miss
                continue
            blocks, ids, data = [], [], []
            for h, p in zip(f.hashes, payloads, strict=True):
                if p is None:
                    break  # a chain: blocks after a miss cannot be used as a prefix
                hb = shelter(h)
                if hb is None:
                    continue
                blocks.append(hb)
                ids.append(hb.block_id)
                data.append(p)
            if ids:
                scatter(caches, ids, data)
                release(blocks)
                landed += len(ids)
        self._fetches = still
        self.blocks_landed += landed
        return landed

    def ready(self, request_id: str) -> bool:
        """May the request be scheduled now? (Its reads landed, or its deadline passed.)"""
        w = self._waiters.get(request_id)
        if w is None:
            return True
        if not any(h in self._fetching for h in w.hashes):
            del self._waiters[request_id]
            return True
        if self.clock() >= w.deadline:
            del self._waiters[request_id]
            self.requests_timed_out += 1
            return True
        return False

    def forget(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def close(self) -> None:
        self.worker.close()
