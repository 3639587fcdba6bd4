"""One thread per replica reading its KV events (ZeroMQ SUB, vLLM's wire format) into the router's index.

Sequence numbers make the stream reliable enough to index: a gap (the PUB socket drops messages when a
subscriber is slow, and a subscriber joining late misses the start) is filled from the replica's replay
socket when it has one; without one, or when the replay no longer holds the missing batches, the replica's
entries are dropped and rebuilt from what follows (a stale index would send requests to blocks that are
gone). A sequence number going backwards means the replica restarted: its device and host tiers are empty.
A first message whose number is not 0 asks for a replay from 0, so a router started after its replicas
still learns what they already cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from kvpool.router.index import PrefixIndex
from kvpool.server.kv_events import END_SEQ, decode_batch

log = logging.getLogger(__name__)


class EventSubscriber:
    def __init__(self, replica: str, endpoint: str, index: PrefixIndex, *, replay_endpoint: str | None = None,
                 topic: str = "", on_batch: Callable[[str, list[dict[str, Any]]], None] | None = None) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = index
        self.on_batch = on_batch
        self.next_seq: int | None = None
        self.batches = 0
        self.gaps = 0
        self.restarts = 0
        self.decode_errors = 0
        self._last_live: int | None = None  # the last sequence number read from the PUB socket
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name=f"kvpool-router-events-{replica}", daemon=True)

    def start(self) -> EventSubscriber:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.term()

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            _, events = decode_batch(payload)
        except ValueError as e:
            self.decode_errors += 1
            log.warning("router: replica %s sent an undecodable event batch (%s)", self.replica, e)
            return
        self.index.apply(self.replica, events)
        self.batches += 1
        self.next_seq = seq + 1
        if self.on_batch is not None:
            self.on_batch(self.replica, events)

    def _replay(self, start: int) -> bool:
        """Ask the replay socket for every batch from `start`; False if it cannot fill the gap."""
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
                    return not first or start == 0
                seq = int.from_bytes(seq_b, "big")
                if first and seq != start:
                    return False  # the replay buffer no longer reaches back that far
                first = False
                self._apply(seq, payload)
        except zmq.ZMQError as e:
            log.warning("router: replay from replica %s failed (%s)", self.replica, e)
            return False
        finally:
            sock.close(0)

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.connect(self.endpoint)
        # Catch up at once when the replica has history (the router started after it).
        if self._replay(0) and self.next_seq is not None:
            log.info("router: replica %s: replayed %d event batches", self.replica, self.batches)
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    self.decode_errors += 1
                    continue
                _, seq_b, payload = frames
                seq = int.from_bytes(seq_b, "big")
                expected = self.next_seq
                last_live, self._last_live = self._last_live, seq
                if expected is not None and seq < expected:
                    if last_live is None or seq > last_live:
                        continue  # a batch the replay already applied (the live stream never goes back)
                    self.restarts += 1
                    log.warning("router: replica %s restarted its event stream; forgetting its blocks", self.replica)
                    self.index.clear(self.replica)
                    self.next_seq = None
                    if seq != 0 and self._replay(0):
                        continue
                elif seq != (expected or 0):
                    self.gaps += 1
                    begin = expected or 0
                    if not self._replay(begin) or self.next_seq is None or self.next_seq < seq:
                        log.warning("router: replica %s: event batches %d..%d lost; rebuilding its index",
                                    self.replica, begin, seq - 1)
                        self.index.clear(self.replica)
                    elif seq < self.next_seq:
                        continue  # the replay covered this batch too
                self._apply(seq, payload)
        finally:
            sub.close(0)
