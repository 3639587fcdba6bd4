"""KV events over ZeroMQ: a subscriber sees BlockStored with exactly the request's block hashes, in
order and chained, and AllBlocksCleared after a reset."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import zmq
from server_helpers import BLOCK, make_engine

from kvpool.core.hashing import BlockHasher
from kvpool.core.request import CacheRequest
from kvpool.server.kv_events import decode_batch
from kvpool.server.serve import start_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_subscriber_sees_stored_blocks_and_a_reset(chat_llama_dir: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    h = start_server(make_engine(chat_llama_dir, enable_kv_events=True), served_model_name="tiny",
                     kv_events_endpoint=endpoint)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(endpoint)
    try:
        time.sleep(0.3)  # a PUB socket drops messages sent before the subscription reaches it
        prompt = list(range(100, 100 + 3 * BLOCK + 5))
        r = httpx.post(f"{h.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events" and int.from_bytes(seq, "big") == 0
        _, events = decode_batch(payload)
        stored = [e for e in events if e["type"] == "BlockStored"]
        want = CacheRequest("ref", prompt, hasher=BlockHasher(BLOCK)).block_hashes[:3]  # the prompt's full blocks
        assert [h for e in stored for h in e["block_hashes"]] == want
        first = stored[0]
        assert first["parent_block_hash"] is None and first["token_ids"][:BLOCK] == prompt[:BLOCK]
        assert first["block_size"] == BLOCK and first["medium"] == "GPU"
        # The reset is published at once, with no step after it (a router must not route by cleared blocks).
        assert httpx.post(f"{h.url}/reset_prefix_cache").json() == {"reset": True}
        seen: list = []
        while not any(e["type"] == "AllBlocksCleared" for e in seen):
            _, seq, payload = sub.recv_multipart()
            seen += decode_batch(payload)[1]
        assert int.from_bytes(seq, "big") >= 1
    finally:
        sub.close(0)
        ctx.term()
        h.stop()
