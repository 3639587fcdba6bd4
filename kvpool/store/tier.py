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
  versus the recompute time the engine measures on its own prompt steps (`observe_compute`) decides
  whether a request waits; if not, the read still goes out behind it (one at a time, as for a slow store),
  so its blocks land for later requests and the estimate follows the store when it speeds up;
- no request may wait behind another's load (vLLM issue 44294: a shared in-flight load serialised
  concurrent requests, 12x TTFT): a hash already being read is not read twice, but every request keeps its
  own deadline, so sharing a read never makes anyone wait longer than its own budget;
- a store slower than the deadline must not cost every request its whole deadline: after `SLOW_AFTER`
  requests in a row waited in vain, requests stop waiting (one read at a time still goes out, so blocks
  keep landing for later requests), until a read comes back within the deadline again.
Landed payloads are written into host blocks (`HostBlockPool.shelter`, pinned while written, then
released), so the ordinary lookup finds them as host hits and swaps them in.

Models with several layer groups (`kvpool.store.hybrid`) use the same waiting and landing, through
`request_arrived_with` (the read is a job that decides what to read on the worker thread) and
`land_with` (payloads routed by the caller to the host pool of their page type). Their reads are not
chains: a hit needs some blocks of each group, not a run from the first, so a miss does not cut the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvpool.store.base import moving_average
from kvpool.store.blocks import Caches, block_nbytes, scatter
from kvpool.store.worker import StoreWorker

log = logging.getLogger(__name__)


@dataclass
class _Fetch:
    hashes: list[bytes]
    future: Future[list[Any]]  # per hash a payload (opaque here: the sink knows it) or None for a miss
    started: float
    chain: bool = True  # a prefix chain: blocks after a miss are no use as a prefix and are not landed


@dataclass
class _Waiter:
    hashes: list[bytes]
    deadline: float


class StoreTier:
    SLOW_AFTER = 3  # requests in a row whose deadline passed before their read landed
    COMPUTE_EWMA = 0.2  # weight of the latest step in the recompute-cost average

    def __init__(self, worker: StoreWorker, *, deadline_s: float = 2.0, block_bytes: int = 0,
                 recompute_s_per_block: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.worker = worker
        self.deadline_s = deadline_s
        self.block_bytes = block_bytes
        self._wrong_size: tuple[int, int] | None = None
        # Seconds to recompute one block, if known (the engine times its prompt steps: `observe_compute`):
        # a request does not wait on a read expected to take longer; the read goes out behind it.
        self.recompute_s_per_block = recompute_s_per_block
        self.clock = clock
        self._fetches: list[_Fetch] = []
        self._fetching: set[bytes] = set()
        self._waiters: dict[str, _Waiter] = {}
        self.blocks_written = 0
        self.blocks_landed = 0
        self.reads_skipped_slow = 0  # requests not held for a read (slow store, or slower than recomputing)
        self.reads_skipped_recompute = 0  # of those, because computing the blocks was expected to be faster
        self.requests_waited = 0
        self.requests_timed_out = 0
        self._late = 0  # requests in a row whose deadline passed before their read landed
        self.slow = False  # the store answers slower than the deadline: requests do not wait on it

    @property
    def stats(self) -> Any:
        return self.worker.stats

    # -- writes ---------------------------------------------------------------------------------------

    def write(self, blocks: Sequence[tuple[bytes, bytes]], tags: Sequence[Any] | None = None) -> int:
        """Queue (key, payload) pairs already copied out of the host tensors; returns how many were queued.
        `tags` (one per block): handed back by `take_written` once their block is in the store."""
        n = self.worker.write(blocks, tags) if blocks else 0
        self.blocks_written += n
        return n

    # -- reads ----------------------------------------------------------------------------------------

    def request_arrived(self, request_id: str, hashes: Sequence[bytes]) -> bool:
        """Start reading `hashes` (the blocks past the request's device + host hit, in chain order).
        Returns True when the request should wait for them."""
        want = list(hashes)
        if not want or not self.worker.store.available:
            return False  # nothing to read, or the store is known down: no request waits on it
        if self.slow or self._slower_than_recompute(len(want), len(want)):
            self._read_behind(want, self.worker.fetch, chain=True)
            return False
        self._read(want, self.worker.fetch, chain=True)
        return self._wait(request_id, want)

    def _slower_than_recompute(self, num_keys: int, num_blocks: int, round_trips: int = 1) -> bool:
        """Would reading `num_keys` values take longer than computing the `num_blocks` token blocks they
        hold (LMCache issue 914)? Unknown (no read found anything yet, or no step was timed yet) is no."""
        if self.recompute_s_per_block is None or not self.block_bytes:
            return False
        est = self.stats.estimate_fetch_s(num_keys * self.block_bytes, round_trips)
        if est is None or est <= self.recompute_s_per_block * num_blocks:
            return False
        self.reads_skipped_recompute += 1
        return True

    def observe_compute(self, seconds: float, num_blocks: float) -> None:
        """A forward computed `num_blocks` blocks' worth of prompt tokens in `seconds`: the recompute cost a
        read must beat to be waited on (a moving average, so one slow step does not decide it)."""
        if num_blocks <= 0 or seconds <= 0:
            return
        self.recompute_s_per_block = moving_average(self.recompute_s_per_block, seconds / num_blocks,
                                                    self.COMPUTE_EWMA)

    def _wait(self, request_id: str, keys: list[bytes], deadline: float | None = None) -> bool:
        """The request waits for `keys` to land, or for its deadline."""
        if request_id not in self._waiters:  # (a second wait of one request is not another request waiting)
            self.requests_waited += 1
        self._waiters[request_id] = _Waiter(keys, self.clock() + self.deadline_s if deadline is None else deadline)
        return True

    def _read(self, keys: list[bytes], start: Callable[[list[bytes]], Future[list[Any]]], chain: bool) -> None:
        """Start reading the keys no earlier read is reading already (`start(keys)` gives the read's future)."""
        new = [k for k in keys if k not in self._fetching]
        if new:
            self._fetches.append(_Fetch(new, start(new), self.clock(), chain=chain))
            self._fetching.update(new)

    def _read_behind(self, want: list[bytes], start: Callable[[list[bytes]], Future[list[Any]]], chain: bool) -> None:
        """A slow store: no request waits, and one read at a time goes out for blocks to land for later
        requests (and to find out when the store is fast again)."""
        self.reads_skipped_slow += 1
        if not self._fetches:
            self._read(want, start, chain)

    def fetching_any(self, keys: Sequence[bytes]) -> bool:
        """Whether an earlier request's read is reading any of `keys` now."""
        return any(k in self._fetching for k in keys)

    def request_arrived_with(self, request_id: str, keys: Sequence[bytes],
                             make_job: Callable[[list[bytes]], Callable[[Any], list[Any]]],
                             cost: tuple[int, int] | None = None, deadline: float | None = None) -> bool:
        """Like `request_arrived`, for a read that decides on the worker thread what to read: `keys` are
        every key the request may need; `make_job(owned)` gives the job reading the ones not already being
        read by an earlier request (`owned`), which returns per owned key a payload for `land_with`'s sink
        or None. The request waits for all of `keys` (its own job and the earlier ones), or its deadline.
        `cost`: (values the read is expected to fetch, token blocks they spare computing), for the
        read-or-recompute choice; the job costs two round trips (EXISTS, then GET). Default: one per key.
        `deadline`: when the request stops waiting (default: the tier's deadline from now)."""
        want = list(keys)
        if not want or not self.worker.store.available:
            return False

        def start(owned: list[bytes]) -> Future[list[Any]]:
            return self.worker.submit(make_job(owned), [None] * len(owned))

        fetch, spared = cost if cost is not None else (len(want), len(want))
        if self.slow or self._slower_than_recompute(fetch, spared, round_trips=2):
            self._read_behind(want, start, chain=False)
            return False
        self._read(want, start, chain=False)
        return self._wait(request_id, want, deadline)

    def land(self, shelter: Callable[[bytes], Any], release: Callable[[list[Any]], None], caches: Caches,
             unshelter: Callable[[list[Any]], None], budget: int | None = None) -> int:
        """Write every completed read into host blocks. `shelter(hash)` gives a pinned host block (or None:
        already there, or no room), `release(blocks)` unpins them once written, and `unshelter(blocks)` gives
        them back empty when the copy fails. `budget`: the most blocks to land now, the host blocks a
        shelter could take before it evicted one landed now (past it, a burst of reads evicted its own
        first landings before their requests ran: every block landed, none hit); the rest are misses, a
        chain cut at a prefix. Returns blocks landed."""

        nbytes = block_nbytes(caches)
        left = [budget]

        def sink(pairs: list[tuple[bytes, Any]]) -> int:
            blocks, ids, data = [], [], []
            for h, p in pairs:
                if left[0] is not None and left[0] <= len(ids):
                    break
                hb = shelter(h)
                if hb is None:
                    continue
                blocks.append(hb)
                ids.append(hb.block_id)
                data.append(p)
            if ids and not self.copied(lambda: scatter(caches, ids, data), unshelter, blocks):
                return 0
            if ids:
                release(blocks)
            if left[0] is not None:
                left[0] -= len(ids)
            return len(ids)

        return self.land_with(sink, lambda p: self.fits(p, nbytes))

    def copied(self, copy: Callable[[], None], unshelter: Callable[[list[Any]], None], blocks: list[Any]) -> bool:
        """Run a landing's copy into host blocks; if it fails, give the blocks back empty (their hashes
        forgotten) and count the values as misses: a store fault never stops a step, nor leaves host
        blocks pinned under keys they do not hold."""
        try:
            copy()
        except Exception:
            log.exception("KV store: writing %d landed values into host blocks failed; treated as misses",
                          len(blocks))
            unshelter(blocks)
            self.stats.add(corrupt=len(blocks))
            return False
        return True

    def fits(self, payload: bytes | bytearray | memoryview, nbytes: int) -> bool:
        """Whether a verified payload is one block of this layout. A value framed and checksummed under this
        fingerprint can still be another size (a writer with a bug, or anyone who can write to a shared
        store): landing it would fail the copy inside the step and stop the engine. It is a corrupt value,
        a miss."""
        if len(payload) == nbytes:
            return True
        self.stats.add(corrupt=1)
        self._wrong_size = (len(payload), nbytes)  # (logged once per landing, by `land_with`)
        return False

    def land_with(self, sink: Callable[[list[tuple[bytes, Any]]], int], fits: Callable[[Any], bool]) -> int:
        """Hand every completed read's (key, payload) pairs to `sink`, which writes them into host blocks
        and returns how many it landed; a payload `fits` refuses (see `fits`) is a miss. A chain read stops
        at its first miss. Returns blocks landed."""
        landed = 0
        still: list[_Fetch] = []
        for f in self._fetches:
            if not f.future.done():
                still.append(f)
                continue
            self._fetching.difference_update(f.hashes)
            if self.clock() - f.started <= self.deadline_s:
                # Back within a deadline (seen at the first step after it came: a step late at most).
                if self.slow:
                    log.warning("KV store reads are back within the %.1fs deadline; requests wait for them again",
                                self.deadline_s)
                self.slow = False
                self._late = 0
            try:
                payloads = f.future.result()
            except Exception:  # the worker already logged it; a failed read is a miss
                continue
            pairs: list[tuple[bytes, Any]] = []
            for h, p in zip(f.hashes, payloads, strict=True):
                if p is None or not fits(p):
                    if f.chain:
                        break  # a chain: blocks after a miss cannot be used as a prefix
                    continue
                pairs.append((h, p))
            if pairs:
                landed += sink(pairs)
        self._fetches = still
        self.blocks_landed += landed
        if self._wrong_size is not None:
            log.warning("KV store: values of the wrong size (%d bytes where a block has %d, the last one); "
                        "treated as misses", *self._wrong_size)
            self._wrong_size = None
        return landed

    def ready(self, request_id: str) -> bool:
        """May the request be scheduled now? (Its reads landed, or its deadline passed.)"""
        w = self._waiters.get(request_id)
        if w is None:
            return True
        if not any(h in self._fetching for h in w.hashes):
            del self._waiters[request_id]
            self._late = 0
            return True
        if self.clock() >= w.deadline:
            del self._waiters[request_id]
            self.requests_timed_out += 1
            self._late += 1
            if self._late >= self.SLOW_AFTER and not self.slow:
                self.slow = True
                log.warning("KV store reads keep missing the %.1fs deadline (%d requests in a row); requests stop "
                            "waiting for them until one comes back in time", self.deadline_s, self._late)
            return True
        return False

    def forget(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def close(self) -> None:
        self.worker.close()
