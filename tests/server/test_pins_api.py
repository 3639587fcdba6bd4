"""Pinned prefixes over HTTP: POST/GET/DELETE /v1/pins behind the API key, 409 over budget, /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import make_engine, metric

from kvpool.server.serve import ServerHandle, start_server

KEY = {"Authorization": "Bearer sekrit"}


@pytest.fixture(scope="module")
def pinned_server(chat_llama_dir: Path) -> Iterator[ServerHandle]:
    # 255 usable blocks of 16 tokens, 5%: 12 blocks may be pinned.
    h = start_server(make_engine(chat_llama_dir, pin_budget=0.05), served_model_name="tiny", api_key="sekrit")
    yield h
    h.stop()


def test_pin_lifecycle(pinned_server: ServerHandle) -> None:
    url = pinned_server.url
    prompt = list(range(1000, 1000 + 16 * 5 + 3))  # 5 full blocks
    assert httpx.post(f"{url}/v1/pins", json={"prompt": prompt}).status_code == 401
    r = httpx.post(f"{url}/v1/pins", json={"prompt": prompt, "ttl": 600}, headers=KEY)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["num_blocks"] == 5 and pin["num_tokens"] == 80 and 0 < pin["expires_in"] <= 600
    assert metric(url, "kvpool:pinned_blocks") == 5 and metric(url, "kvpool:pinned_prefixes") == 1
    listed = httpx.get(f"{url}/v1/pins", headers=KEY).json()["data"]
    assert [p["id"] for p in listed] == [pin["id"]] and listed[0]["block_ids"] == pin["block_ids"]
    # Over the budget (5 pinned + 8 > 12): refused whole, nothing more pinned.
    r = httpx.post(f"{url}/v1/pins", json={"prompt": list(range(3000, 3000 + 16 * 8))}, headers=KEY)
    assert r.status_code == 409 and r.json()["error"]["param"] == "prompt"
    assert "8 more blocks would exceed the pin budget of 12 blocks (5 pinned, 7 left)" in r.json()["error"]["message"]
    assert metric(url, "kvpool:pinned_blocks") == 5
    # A request sharing the prefix hits all of its blocks.
    c = httpx.post(f"{url}/v1/completions", headers=KEY,
                   json={"prompt": [*prompt[:80], 7, 8], "max_tokens": 1, "temperature": 0})
    assert c.status_code == 200 and c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
    assert httpx.delete(f"{url}/v1/pins/{pin['id']}").status_code == 401
    assert httpx.delete(f"{url}/v1/pins/{pin['id']}", headers=KEY).json()["deleted"] is True
    assert httpx.delete(f"{url}/v1/pins/{pin['id']}", headers=KEY).status_code == 404
    assert metric(url, "kvpool:pinned_blocks") == 0
    # Usage as of now: the unpin ran no step, and the pinned blocks are free again.
    assert metric(url, "kvpool:kv_cache_usage_perc") == 0


def test_bad_pin_bodies(pinned_server: ServerHandle) -> None:
    url = pinned_server.url
    for body in ({"prompt": []}, {"prompt": [1, 2], "ttl": -1}, {"prompt": "x", "extra": 1}):
        assert httpx.post(f"{url}/v1/pins", json=body, headers=KEY).status_code == 400, body
    r = httpx.post(f"{url}/v1/pins", json={"prompt": [1, 2, 3]}, headers=KEY)  # shorter than a block
    assert r.status_code == 400 and "no full block" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"
    # Longer than the context: what is wrong with it, not that it is over the budget.
    r = httpx.post(f"{url}/v1/pins", json={"prompt": list(range(600))}, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"].startswith("prompt: the prefix has 600 tokens; the context holds 512")
    r = httpx.post(f"{url}/v1/pins", json={"prompt": [1, 10**6] * 16}, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt: token ids must be in")
