"""KV cache events for cache-aware routers, on ZeroMQ, in vLLM's wire format (vLLM 0.33,
`vllm.distributed.kv_events`), so routers written for vLLM replicas (llm-d's indexer, Dynamo's KV router,
kvpool's own `kvpool.router`) index kvpool replicas unchanged.

The wire, as vLLM's `ZmqEventPublisher` sends it:
- PUB socket, one multipart message per engine step with events: [topic, sequence number (8-byte
  big-endian, from 0, +1 per message), payload].
- payload: msgpack of `KVEventBatch`, an array [ts (float seconds), events, data_parallel_rank].
- each event: a msgpack map tagged with its class name under "type" (msgspec's tagged union), fields by
  name; fields at their default are left out (msgspec's omit_defaults), the required ones always sent:
    {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
     "medium", "lora_name"[, "extra_keys"][, "group_idx"]}
    {"type": "BlockRemoved", "block_hashes", "medium"[, "group_idx"]}
    {"type": "AllBlocksCleared"}
- replay (optional): a ROUTER socket; a client (REQ or DEALER) sends [start sequence (8-byte big-endian)]
  and gets every buffered message from that number on as [topic, seq, payload], then the end marker
  [b"", seq -1 (8 bytes, signed), info]. A subscriber that saw a gap in the sequence numbers asks here.
  vLLM's end marker carries nothing (info b""); kvpool's carries msgpack {"instance": str, "next_seq": int}:
  an id drawn at each publisher start, and the number the next batch will get. A subscriber that sees the
  instance change knows the replica restarted (its tiers are empty) even when the new stream's numbers do not
  go backwards where it looks; vLLM's subscribers ignore the end marker's payload, and the batches themselves
  stay exactly vLLM's. Asking from a number no buffer reaches (`PROBE_SEQ`) gets the end marker alone.

kvpool's names map to vLLM's: medium "device" -> "GPU" (the tier attention reads, whatever the device),
"host" -> "CPU", "store" -> "STORAGE"; a string LoRA id goes to `lora_name`, an int one to `lora_id` (and
its name); extra keys are sent per block, untagged, as vLLM does. Block hashes are kvpool's bytes.

Sockets are created on the caller's thread (so a bad endpoint fails at start-up) and then used only by
the publisher thread, which also answers replay requests; the engine thread only enqueues.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from typing import Any

import msgpack
import zmq

from kvpool.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.engine.async_engine import StepReport

log = logging.getLogger(__name__)

MEDIUMS = {"device": "GPU", "host": "CPU", "store": "STORAGE"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
PROBE_SEQ = (1 << 64) - 1  # a replay start no buffer reaches: the reply is the end marker alone


def end_marker_info(payload: bytes) -> tuple[str | None, int | None]:
    """(instance, next_seq) of a replay's end marker; (None, None) for vLLM's empty one or one not kvpool's."""
    try:
        info = msgpack.unpackb(payload, raw=False) if payload else None
    except Exception:
        return None, None
    if not isinstance(info, dict):
        return None, None
    instance, next_seq = info.get("instance"), info.get("next_seq")
    return (instance if isinstance(instance, str) and instance else None,
            next_seq if isinstance(next_seq, int) and not isinstance(next_seq, bool) else None)


def _untagged(keys: tuple[tuple[object, ...], ...]) -> tuple[Any, ...] | None:
    """One block's extra keys as vLLM publishes them: LoRA name (and kvpool's digest of the adapter's files
    after it: part of the hash), (mm id, offset) pairs, salt, untagged."""
    out: list[Any] = []
    for k in keys:
        if k[0] == "mm":
            out.append([k[1], k[2]])
        else:  # (LoRA: its name, then the digest of its files; a router hashes a LoRA request with both)
            out.append(k[1])
    return tuple(out) or None


def _per_block_extra_keys(e: BlockStored) -> list[Any] | None:
    ek: Any = e.extra_keys
    if not ek:
        return None
    # One block's keys ((tag, ...), ...) or a list with one entry per block (each such a tuple, or None).
    if all(isinstance(k, tuple) and k and isinstance(k[0], str) for k in ek):
        per_block = [ek] * len(e.block_hashes)
    else:
        per_block = list(ek)
    out = [_untagged(tuple(k)) if k else None for k in per_block]
    return out if any(k is not None for k in out) else None


def encode_event(e: KVCacheEvent) -> dict[str, Any]:
    """One event as the map vLLM's msgspec classes encode (and decode)."""
    if isinstance(e, BlockStored):
        lora_id = e.lora_id if isinstance(e.lora_id, int) else None
        lora_name = None if e.lora_id is None else str(e.lora_id)
        d: dict[str, Any] = {"type": "BlockStored", "block_hashes": list(e.block_hashes),
                             "parent_block_hash": e.parent_block_hash, "token_ids": list(e.token_ids),
                             "block_size": e.block_size, "lora_id": lora_id,
                             "medium": MEDIUMS.get(e.medium, e.medium), "lora_name": lora_name}
        extra = _per_block_extra_keys(e)
        if extra is not None:
            d["extra_keys"] = extra
        d["group_idx"] = e.group_id
        return d
    if isinstance(e, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes),
                "medium": MEDIUMS.get(e.medium, e.medium), "group_idx": e.group_id}
    if isinstance(e, AllBlocksCleared):
        # vLLM's AllBlocksCleared has no fields: a subscriber drops every tier of the replica. kvpool
        # clears all tiers together (reset_prefix_cache), so nothing is lost by leaving the medium out.
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV cache event: {e!r}")


def encode_batch(events: list[KVCacheEvent], ts: float | None = None, data_parallel_rank: int = 0) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, [encode_event(e) for e in events], data_parallel_rank],
                         use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """For subscribers and tests: (timestamp, events) of one published payload, each event a dict with
    its "type". Raises ValueError on a payload that is not an event batch."""
    try:
        batch = msgpack.unpackb(payload, raw=False)
    except Exception as e:
        raise ValueError(f"payload: not msgpack ({e})") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("payload: not a KV event batch [ts, events, rank]")
    events = batch[1]
    for ev in events:
        if not isinstance(ev, dict) or "type" not in ev:
            raise ValueError(f"payload: event without a type tag: {ev!r}")
    ts = batch[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise ValueError(f"payload: the batch's timestamp is not a number: {ts!r}")
    return float(ts), events


class KVEventPublisher:
    """Publishes each step's events as vLLM does, with an optional replay socket."""

    def __init__(self, endpoint: str, topic: str = "kv-events", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._replay: zmq.Socket[Any] | None = None
        self._queue: queue.SimpleQueue[list[KVCacheEvent] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        # Drawn per publisher (so per process start): told in every replay's end marker, it lets a subscriber
        # tell a restarted replica from one whose batches it already has, whatever numbers it saw before.
        self.instance = uuid.uuid4().hex
        self._thread: threading.Thread | None = None
        self._running = False

    def bind(self) -> None:
        """Bind now, so a bad endpoint fails at start-up rather than on the first event."""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.set_hwm(self.hwm)
        # One try per socket, so the error names the endpoint that failed (both are flags of their own).
        try:
            self._sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"kv_events_endpoint: cannot bind ({e})") from None
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # A full replay plus its end marker must fit, or a slow client's replay is cut silently.
            self._replay.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
            try:
                self._replay.bind(self.replay_endpoint)
            except zmq.ZMQError as e:
                self.close()
                raise ValueError(f"kv_events_replay_endpoint: cannot bind ({e})") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvpool-kv-events", daemon=True)
        self._thread.start()

    def observe(self, report: StepReport) -> None:
        """Engine-thread listener: hand the step's events to the publisher thread."""
        if report.kv_events and self._running:
            self._queue.put(list(report.kv_events))

    def publish(self, events: list[KVCacheEvent]) -> None:
        if events and self._running:
            self._queue.put(list(events))

    def _run(self) -> None:
        assert self._sock is not None
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    try:
                        self._serve_replay()
                    except Exception:
                        log.exception("KV events: replay request failed")
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            try:
                payload = encode_batch(events)
                seq = self._seq.to_bytes(8, "big")
                self._sock.send_multipart([self.topic, seq, payload])
                self._buffer.append((self._seq, payload))
                self._seq += 1
            except Exception:
                log.exception("KV events: publishing a batch failed")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # [client id, empty delimiter, start seq]
            log.warning("KV events: malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
        info = msgpack.packb({"instance": self.instance, "next_seq": self._seq})
        self._replay.send_multipart([client, b"", b"", END_SEQ, info])

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(5)
            self._thread = None
        self._running = False
        for s in (self._sock, self._replay):
            if s is not None:
                s.close(0)
        self._sock = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
