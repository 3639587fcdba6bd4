"""Helpers of the server tests: an engine on the tiny chat Llama, a reader of /metrics, a client that leaves."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvpool.engine.engine import LLMEngine
from kvpool.server.serve import ServerHandle

BLOCK = 16


def make_engine(model_dir: Path, **kw: object) -> LLMEngine:
    args: dict[str, object] = dict(model=str(model_dir), dtype="float32", num_blocks=256, block_size=BLOCK,
                                   max_model_len=512, max_num_batched_tokens=256)
    args.update(kw)
    return LLMEngine(**args)  # type: ignore[arg-type]


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics, summed over the samples that carry `labels` (0 for a labelled series not
    yet created; a KeyError for a metric that does not exist)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    total, seen = 0.0, False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total, seen = total + s.value, True
    if not seen and not labels:
        raise KeyError(name)
    return total


def leave_early(url: str, body: dict, servers: Sequence[ServerHandle], wait_s: float = 1.0) -> None:
    """Send a non-streaming request whose client gives up after `wait_s`. The engines are held between
    steps from the moment it is pending until the client has been gone a while, so the request cannot
    finish first however fast the model is. Returns once no engine has anything pending."""
    gate = threading.Event()

    def send() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(url, json=body, timeout=wait_s)

    t = threading.Thread(target=send)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not any(s.engine.num_pending for s in servers):
            assert time.monotonic() < deadline, "the request never reached an engine"
            time.sleep(0.002)
        for s in servers:
            s.engine.call_soon(lambda e: gate.wait(30))
        t.join()
        time.sleep(1.0)  # the server (and a router in front) notice the client is gone
    finally:
        gate.set()
        t.join()
    deadline = time.monotonic() + 10
    while any(s.engine.num_pending for s in servers):
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
