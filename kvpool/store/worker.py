"""Store I/O off the critical path: one background thread with a bounded queue per direction.

The engine thread only enqueues: `write` hands over (hash, payload) pairs (the caller has already copied
the bytes out of any buffer a later swap could overwrite) and `fetch` returns a Future at once (`submit`
runs any read job the same way: hybrid models probe with EXISTS, decide, then read, in one job). The
thread merges queued writes into one round trip, and queued fetches into one read (a slow store must not
serve a burst of requests one round trip each, each waiting behind the others), and serves fetches before
writes, since a waiting request is waiting on a fetch while a write only helps some later request. The
write queue is bounded in blocks and in bytes (a block of a large model is tens of MiB); when it is full
the new blocks are dropped and counted (a slow store must not grow memory without bound, nor make the
engine wait), which is the same as a miss later. A closed worker answers every fetch with misses.

A write may carry a tag per block (the engine's `BlockStored` event for it): the tags of the blocks the
store accepted come back through `take_written`, so the replica tells routers only of blocks that really
are in the store (not of ones dropped, or refused by a store that is down or full).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvpool.store.base import BlockStore, StoreStats

log = logging.getLogger(__name__)

Payload = bytes | bytearray | memoryview


class StoreWorker:
    def __init__(self, store: BlockStore, *, max_pending_writes: int = 4096, max_pending_bytes: int = 256 << 20,
                 max_batch: int = 64, max_read_blocks: int = 256) -> None:
        self.store = store
        self.max_pending_writes = max_pending_writes
        self.max_pending_bytes = max_pending_bytes
        self.max_batch = max_batch
        self.max_read_blocks = max_read_blocks  # blocks one merged read asks for at most
        self._writes: deque[tuple[bytes, Payload]] = deque()
        self._pending_bytes = 0
        # Read jobs and their futures: (job, future, None), a job being a callable given the BlockStore, or
        # (None, future, hashes) for a plain read of blocks (merged with the other queued ones); None wakes
        # the thread to exit.
        self._fetches: queue.SimpleQueue[tuple[Callable[[BlockStore], Any] | None, Future[Any], list[bytes] | None]
                                         | None] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._closed = False
        self._inflight: set[bytes] = set()  # hashes queued or being written: no duplicate writes
        self._tags: dict[bytes, Any] = {}  # queued hash -> its tag, handed back once the store took it
        self._written: deque[Any] = deque()  # tags of written blocks, for `take_written`
        self._thread = threading.Thread(target=self._run, name="kvpool-store", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> StoreStats:
        return self.store.stats

    def write(self, blocks: Sequence[tuple[bytes, Payload]], tags: Sequence[Any] | None = None) -> int:
        """Queue blocks for writing; returns how many were queued (the rest were dropped: queue full).
        `tags` (one per block, None for none) come back from `take_written` once their block is stored."""
        if tags is not None and len(tags) != len(blocks):
            raise ValueError(f"tags: one per block, got {len(tags)} for {len(blocks)} blocks")
        queued = dropped = 0
        with self._cv:
            if self._closed:
                return 0
            for i, (h, p) in enumerate(blocks):
                if h in self._inflight:
                    continue  # (queued already: neither queued again nor dropped)
                n = len(p)
                if len(self._writes) >= self.max_pending_writes or self._pending_bytes + n > self.max_pending_bytes:
                    dropped += 1
                    continue
                self._writes.append((h, p))
                self._inflight.add(h)
                if tags is not None and tags[i] is not None:
                    self._tags[h] = tags[i]
                self._pending_bytes += n
                queued += 1
            if dropped:
                self.store.stats.add(dropped_puts=dropped)
            self._cv.notify()
        return queued

    def fetch(self, hashes: Sequence[bytes]) -> Future[list[bytes | None]]:
        """Payloads of the blocks (None per miss), read in one round trip on the worker thread."""
        want = list(hashes)
        fut: Future[list[bytes | None]] = Future()
        if self._closed:
            fut.set_result([None] * len(want))
            return fut
        self._fetches.put((None, fut, want))
        with self._cv:
            self._cv.notify()
        return fut

    def submit(self, job: Callable[[BlockStore], Any], if_closed: Any) -> Future[Any]:
        """Run a read job on the worker thread (before any queued write); `if_closed` is the answer of a
        closed worker (misses). A job sees the `BlockStore`, whose calls turn faults into misses."""
        fut: Future[Any] = Future()
        if self._closed:
            fut.set_result(if_closed)
            return fut
        self._fetches.put((job, fut, None))
        with self._cv:
            self._cv.notify()
        return fut

    def take_written(self) -> list[Any]:
        """The tags of the blocks written since the last call, in the order they were stored."""
        out = []
        while self._written:  # (deque.popleft is atomic: the worker thread appends meanwhile)
            out.append(self._written.popleft())
        return out

    def has_written(self) -> bool:
        return bool(self._written)

    def pending_writes(self) -> int:
        with self._cv:
            return len(self._inflight)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write has been attempted (tests, benchmarks, shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._inflight, timeout)

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._fetches.put(None)
        self._thread.join(timeout)
        self.store.close()

    def _run(self) -> None:
        self.store.probe()
        while True:
            with self._cv:
                # While the store is down, wake after its back-off to probe it: reads are not even
                # tried while it is down (no request waits on a dead store), so without a probe a
                # replica that writes nothing would never notice it is back.
                woke = self._cv.wait_for(lambda: self._closed or self._writes or not self._fetches.empty(),
                                         timeout=None if self.store.available else max(0.05, self.store.retry_after_s))
                if self._closed and not self._writes and self._fetches.empty():
                    return
            if not woke:
                self.store.probe()
                continue
            # Fetches first: a request is waiting on them.
            reads: list[tuple[Future[Any], list[bytes]]] = []
            while True:
                try:
                    job = self._fetches.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    continue
                fn, fut, want = job
                if want is not None:
                    reads.append((fut, want))
                    continue
                try:
                    fut.set_result(fn(self.store))  # type: ignore[misc]
                except Exception as e:  # never let one bad call kill the thread
                    log.exception("KV store fetch failed")
                    fut.set_exception(e)
            self._read_merged(reads)
            with self._cv:
                batch = [self._writes.popleft() for _ in range(min(self.max_batch, len(self._writes)))]
            if batch:
                stored = False
                try:
                    stored = self.store.put(batch)
                except Exception:
                    log.exception("KV store write failed")
                with self._cv:
                    for h, p in batch:
                        self._inflight.discard(h)
                        self._pending_bytes -= len(p)
                        tag = self._tags.pop(h, None)
                        if stored and tag is not None:
                            self._written.append(tag)
                    self._cv.notify_all()

    def _read_merged(self, reads: list[tuple[Future[Any], list[bytes]]]) -> None:
        """Every queued plain read in as few round trips as `max_read_blocks` allows, each block once."""
        if not reads:
            return
        order = list(dict.fromkeys(h for _, want in reads for h in want))
        got: dict[bytes, bytes | None] = {}
        try:
            for i in range(0, len(order), self.max_read_blocks):
                part = order[i:i + self.max_read_blocks]
                got.update(zip(part, self.store.get(part), strict=True))
        except Exception as e:  # never let one bad call kill the thread
            log.exception("KV store fetch failed")
            for fut, _ in reads:
                fut.set_exception(e)
            return
        for fut, want in reads:
            fut.set_result([got[h] for h in want])
