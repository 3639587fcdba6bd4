"""One thread per replica reading its KV events (ZeroMQ SUB, vLLM's wire format) into the router's index.

Sequence numbers make the stream reliable enough to index: a gap (the PUB socket drops messages when a
subscriber is slow, and a subscriber joining late misses the start) is filled from the replica's replay
socket when it has one. When the replay no longer reaches back to the gap (its buffer moved on), the
replica's entries are dropped and rebuilt from what the buffer still holds and what follows; without a
replay socket, from what follows only (a stale index would send requests to blocks that are gone; one that
misses blocks only costs hits). A sequence number going backwards means the replica restarted: its device
and host tiers are empty. So does a change of the publisher's instance id, which kvpool's replay tells in
its end marker: the subscriber learns it with each replay, and when a live batch's number is below the next
one it expects before any live batch was read (the batch may be one the replay gave it, or the first of a
restarted replica), it asks the replay for the id again rather than guess. A gap's replay tells it too.
(Not seen here: a restart whose lost first batches end right at the number expected next; the batches keep
vLLM's shape, which has no room for the id. The router's health checks see it: a kvpool replica's /health
names its stream's id, and a new one makes the router resync the replica.)
At start-up the subscriber asks for a replay from 0, so a router started after its replicas still learns
what they already cache.

A batch the router cannot use (malformed, or with fields of the wrong type) is skipped like a gap: the
replica's entries are dropped, as the batch may have removed some of them, and the thread goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from kvpool.router.index import PrefixIndex
from kvpool.server.kv_events import END_SEQ, PROBE_SEQ, decode_batch, end_marker_info

log = logging.getLogger(__name__)


class EventSubscriber:
    def __init__(self, replica: str, endpoint: str, index: PrefixIndex, *, replay_endpoint: str | None = None,
                 topic: str = "", on_batch: Callable[[str, list[dict[str, Any]]], None] | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = index
        self.on_batch = on_batch
        self.on_error = on_error
        self.next_seq: int | None = None
        self.batches = 0
        self.gaps = 0
        self.restarts = 0
        self.decode_errors = 0
        self._last_live: int | None = None  # the last sequence number read from the PUB socket
        self._instance: str | None = None  # the publisher's id, as its last replay told it (None: not known)
        self._stop = threading.Event()
        self._resync = threading.Event()
        self._ctx = zmq.Context()
        self._sub: zmq.Socket[Any] | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvpool-router-events-{replica}", daemon=True)

    @property
    def alive(self) -> bool:
        """Whether the thread still reads events (False before `start` and after `stop`)."""
        return self._thread.is_alive()

    def start(self) -> EventSubscriber:
        """Connect (here, so an endpoint ZeroMQ refuses is a ValueError at start-up, not a dead thread) and
        start reading."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        for key, ep in (("events", self.endpoint), ("replay", self.replay_endpoint)):
            if ep is None:
                continue
            sock = sub if key == "events" else self._ctx.socket(zmq.DEALER)  # (replays connect one per gap)
            try:
                sock.connect(ep)
                error = None
            except zmq.ZMQError as e:
                error = e
            if sock is not sub:
                sock.close(0)
            if error is not None:
                sub.close(0)
                self._ctx.term()
                raise ValueError(f"replica: {key}={ep!r} of {self.replica}: {error}")
        self._sub = sub  # (handed to the thread: ZeroMQ sockets may move between threads at a barrier)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        elif self._sub is not None:
            self._sub.close(0)
        self._ctx.term()

    def resync(self) -> None:
        """Forget the replica's entries and rebuild them from its replay (it came back after being down,
        perhaps restarted with empty caches); done on the subscriber's thread."""
        self._resync.set()

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1  # (a batch that cannot be used is skipped, not asked for again)
        try:
            _, events = decode_batch(payload)
            self.index.apply(self.replica, events)
        except Exception as e:  # (a timestamp of null is a TypeError, a hash of the wrong type a ValueError)
            self.decode_errors += 1
            log.warning("router: replica %s sent an unusable event batch %d (%s); rebuilding its index",
                        self.replica, seq, e)
            self.index.clear(self.replica)
            if self.on_error is not None:
                self.on_error(self.replica)
            return
        self.batches += 1
        if self.on_batch is not None:
            try:
                self.on_batch(self.replica, events)
            except Exception:
                log.exception("router: replica %s: handling an event batch failed", self.replica)

    def _replay(self, start: int) -> bool:
        """Ask the replay socket for every batch from `start`; False if there is none or it does not answer.
        When its buffer no longer reaches back to `start`, the replica's entries are dropped and rebuilt
        from what the buffer holds (blocks stored before it and still cached stay unknown: a subset of the
        truth, which costs hits but never sends a request to a block that is gone)."""
        if not self.replay_endpoint:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 2000)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            first = True
            while True:
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    return False
                _, _, seq_b, payload = frames
                if seq_b == END_SEQ:
                    instance = end_marker_info(payload)[0]
                    if instance is not None and self._instance is not None and instance != self._instance:
                        # Another process answers: what this replay applied went onto a dead replica's entries.
                        sock.close(0)
                        self._restarted(instance)
                        return self._replay(0)
                    if instance is not None:
                        self._instance = instance
                    return True
                seq = int.from_bytes(seq_b, "big")
                if first and seq != start:
                    log.warning("router: replica %s: its replay starts at batch %d, not %d; rebuilding its index "
                                "from there", self.replica, seq, start)
                    self.index.clear(self.replica)
                first = False
                self._apply(seq, payload)
        except zmq.ZMQError as e:
            log.warning("router: replay from replica %s failed (%s)", self.replica, e)
            return False
        finally:
            sock.close(0)

    def _restarted(self, instance: str | None) -> None:
        """The replica restarted (its tiers are empty): forget its entries; `instance` is its new id, if known."""
        self.restarts += 1
        log.warning("router: replica %s restarted its event stream; forgetting its blocks", self.replica)
        self.index.clear(self.replica)
        self.next_seq = None
        self._instance = instance

    def _run(self) -> None:
        sub = self._sub
        assert sub is not None
        try:
            # Catch up at once when the replica has history (the router started after it).
            if self._replay(0) and self.next_seq is not None:
                log.info("router: replica %s: replayed %d event batches", self.replica, self.batches)
            while not self._stop.is_set():
                if self._resync.is_set():
                    self._resync.clear()
                    self.index.clear(self.replica)
                    self.next_seq = self._last_live = self._instance = None
                    self._replay(0)
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                try:
                    self._receive(frames)
                except Exception:  # nothing one message holds may end the thread: its index would go stale
                    self.decode_errors += 1
                    log.exception("router: replica %s: an event message failed; rebuilding its index", self.replica)
                    self.index.clear(self.replica)
                    self.next_seq = None
        finally:
            sub.close(0)

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.decode_errors += 1
            return
        _, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big")
        expected = self.next_seq
        last_live, self._last_live = self._last_live, seq
        if expected is not None and seq < expected:
            if last_live is not None and seq > last_live:
                return  # a batch the replay already applied (the live stream never goes back)
            if last_live is None:
                # No live batch before this one: it may be one the replay already applied, or the first
                # batches of a replica that restarted since (numbering from 0 again). Only the publisher's
                # id tells: ask for it (a restart found there is handled by `_replay`, which replays anew).
                restarts = self.restarts
                if self._instance is not None and self._replay(PROBE_SEQ):
                    if self.restarts == restarts:
                        return  # the same publisher: the replay gave this batch already
                    if self.next_seq is not None and self.next_seq > seq:
                        return  # the new publisher's replay covered this batch
                    self._apply(seq, payload)
                    return
                # No id to compare (a publisher that does not tell it, or a replay that did not answer):
                # rebuild from the replay, which is right in either case; only a restart seen is counted.
                log.info("router: replica %s: live batch %d below the replayed %d; rebuilding its index",
                         self.replica, seq, expected)
                self.index.clear(self.replica)
                self.next_seq = None
            else:
                self._restarted(None)  # (the id is learned again from the replay below)
            if seq != 0 and self._replay(0) and self.next_seq is not None and self.next_seq > seq:
                return
        elif seq != (expected or 0):
            self.gaps += 1
            begin = expected or 0
            if not self._replay(begin) or self.next_seq is None or self.next_seq < seq:
                log.warning("router: replica %s: event batches %d..%d lost; rebuilding its index",
                            self.replica, begin, seq - 1)
                self.index.clear(self.replica)
            elif seq < self.next_seq:
                return  # the replay covered this batch too
        self._apply(seq, payload)
