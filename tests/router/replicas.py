"""Helpers of the router tests: start N replicas with KV events, and a router in front of them."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from server_helpers import make_engine

from kvpool.router.app import ReplicaSpec, Router, RouterHandle, start_router
from kvpool.server.serve import ServerHandle, start_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(model_dir: Path, events: bool = True, **engine_kw: Any) -> tuple[ServerHandle, ReplicaSpec]:
    if not events:
        h = start_server(make_engine(model_dir, **engine_kw), served_model_name="tiny")
        return h, ReplicaSpec(h.url)
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    h = start_server(make_engine(model_dir, enable_kv_events=True, **engine_kw), served_model_name="tiny",
                     kv_events_endpoint=pub, kv_events_replay_endpoint=replay)
    return h, ReplicaSpec(h.url, events=pub, replay=replay)


def wait_until(what: Any, timeout: float = 10.0, poll: float = 0.02) -> Any:
    """What `what()` gives once it is truthy; an AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)
    return got


def start_front(specs: list[ReplicaSpec], tokenizer: Any, **kw: Any) -> RouterHandle:
    return start_router(Router(specs, tokenizer=tokenizer, block_size=16, **kw))
