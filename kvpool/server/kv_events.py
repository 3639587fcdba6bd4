"""KV cache events for cache-aware routers, published on a ZeroMQ PUB socket as msgpack (opt-in).

Wire format, as vLLM publishes it: a multipart message [topic, sequence number (8-byte big-endian),
payload], the payload a msgpack array [timestamp, events, data_parallel_rank] where each event is an
array tagged by its type name first:
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, group_id]
  ["BlockRemoved", block_hashes, medium, group_id]
  ["AllBlocksCleared", medium]
A subscriber that replays the stream knows the exact set of block hashes each tier of the replica holds.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import zmq

from kvpool.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.engine.async_engine import StepReport


def encode_event(e: KVCacheEvent) -> list[Any]:
    if isinstance(e, BlockStored):
        lora = e.lora_id if e.lora_id is None or isinstance(e.lora_id, int) else str(e.lora_id)
        return ["BlockStored", list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, lora,
                e.medium, e.group_id]
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", list(e.block_hashes), e.medium, e.group_id]
    if isinstance(e, AllBlocksCleared):
        return ["AllBlocksCleared", e.medium]
    raise TypeError(f"not a KV cache event: {e!r}")


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]]]:
    """For subscribers and tests: (timestamp, events) of one published payload."""
    ts, events, _rank = msgpack.unpackb(payload, raw=False)
    return ts, events


class KVEventPublisher:
    """Publishes each step's events; the socket is created and used on the engine thread only."""

    def __init__(self, endpoint: str, topic: str = "kv-events") -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._seq = 0

    def bind(self) -> None:
        """Bind now, so a bad endpoint fails at start-up rather than on the first event."""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)

    def observe(self, report: StepReport) -> None:
        if not report.kv_events or self._sock is None:
            return
        payload = msgpack.packb([time.time(), [encode_event(e) for e in report.kv_events], 0], use_bin_type=True)
        self._sock.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
