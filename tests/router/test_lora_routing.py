"""LoRA requests through the router: a replica hashes an adapter's blocks under its name and the digest of
its files; the router learns that digest from the replica's BlockStored events and hashes a request for
the adapter (its `model`) the same way, so a LoRA conversation's next turn follows its cache, and a
base-model prefix (which the adapter cannot use) is never counted as its hit."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
from helpers import make_peft_adapter
from replicas import start_front, start_replica
from server_helpers import metric

from kvpool.core.request import CacheRequest
from kvpool.server.serve import add_lora_modules


def test_lora_requests_are_routed_by_the_adapters_own_blocks(chat_llama_dir: Path, chat_tokenizer: Any,
                                                              tmp_path: Path) -> None:
    adapter = make_peft_adapter(chat_llama_dir, tmp_path / "sql", r=8, targets=["q_proj", "v_proj"], seed=1)
    reps = [start_replica(chat_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16) for _ in range(2)]
    for h, _ in reps:
        add_lora_modules(h.engine.engine, [f"sql={adapter}"])
    front = start_front([s for _, s in reps], chat_tokenizer)
    try:
        prompt = "a question for the sql adapter: " + "the quick brown fox jumps over the lazy dog " * 8

        def send(model: str) -> tuple[str, int]:
            r = httpx.post(f"{front.url}/v1/completions", timeout=60,
                           json={"model": model, "max_tokens": 2, "prompt": prompt})
            assert r.status_code == 200, r.text
            return r.headers["x-kvpool-replica"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        first, _ = send("sql")
        deadline = time.monotonic() + 5
        while "sql" not in front.router.lora_digests:
            assert time.monotonic() < deadline, "no BlockStored event named the adapter's digest"
            time.sleep(0.02)
        engine = next(h for h, s in reps if s.url == first).engine.engine
        assert front.router.lora_digests["sql"] == engine.loras.content_digest("sql")
        ids = chat_tokenizer.encode(prompt)
        mine = front.router.block_hashes(ids, None, "sql")
        assert mine == list(CacheRequest("x", ids, hasher=engine.hasher, lora_id="sql",
                                         lora_content=engine.loras.content_digest("sql")).block_hashes)
        time.sleep(3.5)  # past the router's memory of what it just sent: only the events count now
        matched = metric(front.url, "kvpool_router:matched_blocks_total")
        again, cached = send("sql")
        assert again == first and cached > 0
        # What the router credited is what the replica served (a prompt's last token is always computed).
        served = (len(ids) - 1) // 16
        assert metric(front.url, "kvpool_router:matched_blocks_total") - matched == served == cached // 16
        assert served <= len(mine)
        # The same text for the base model: the adapter's blocks are none of its hits, and the other way round.
        matched = metric(front.url, "kvpool_router:matched_blocks_total")
        _, cached = send("tiny")
        assert cached == 0 and metric(front.url, "kvpool_router:matched_blocks_total") == matched
    finally:
        front.stop()
        for h, _ in reps:
            h.stop()
