"""The router and a shared store: replicas publish the blocks the store took (medium STORAGE), so the
router credits every replica with them, as what a store read gives, and the replica it did not come from
really does read them (real replicas, a real file store, real ZeroMQ events)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
from replicas import start_front, start_replica, wait_until

from kvpool.router.index import STORE, TIER_WEIGHTS


def test_a_replica_is_credited_with_what_the_shared_store_holds(chat_llama_dir: Path, chat_tokenizer: Any,
                                                                  tmp_path: Path) -> None:
    store = dict(num_host_blocks=64, write_through=True, kv_store=f"file://{tmp_path}")
    (ha, a), (hb, b) = start_replica(chat_llama_dir, **store), start_replica(chat_llama_dir, **store)
    front = start_front([a, b], chat_tokenizer)
    try:
        ids = [random.Random(7).randrange(100, 1000) for _ in range(60)]  # 3 full blocks of 16
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0}
        first = httpx.post(f"{ha.url}/v1/completions", json=body, timeout=60)  # to a itself, not routed
        assert first.status_code == 200, first.text
        hashes = front.router.route_key("/v1/completions", body).hashes
        assert len(hashes) == 3
        # a wrote the blocks through to the store and published them: b is credited with all three, at the
        # store's weight, though it holds none of them itself. The fourth block, full only with the answer's
        # tokens, went to the store after a's last step: published all the same, by the idle engine.
        wait_until(lambda: front.router.index.num_blocks(STORE) == 4)
        got = front.router.index.match(hashes, [a.url, b.url])
        assert got[b.url] == (3, 3 * TIER_WEIGHTS["STORAGE"]) and got[a.url] == (3, 3.0)
        assert front.router.index.num_blocks(b.url) == 0
        # And it is true: b reads them from the store and answers alike.
        second = httpx.post(f"{hb.url}/v1/completions", json=body, timeout=60)
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    finally:
        front.stop()
        ha.stop()
        hb.stop()
