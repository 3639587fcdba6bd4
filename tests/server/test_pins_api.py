"""Pinned prefixes over HTTP: POST/GET/DELETE /v1/pins behind the API key, 409 over budget, /metrics; a
chat's system prompt pinned by its messages; standing pins (`--pin-prefix`, `--pin-system-prompt`)
made at start and again after a recovery."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import fail_first_step
from server_helpers import make_engine, metric

from kvpool.cli import build_parser
from kvpool.server.serve import ServerHandle, StandingPrefix, read_standing_prefixes, start_server

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
    # Ids no pin has, a slash among them, get the same 404 body (not a redirect to another path).
    for pid in ("%2F", "a/b", "%20"):
        r = httpx.delete(f"{url}/v1/pins/{pid}", headers=KEY)
        assert r.status_code == 404 and r.json()["error"]["message"].startswith("pin: no pin "), pid
    assert metric(url, "kvpool:pinned_blocks") == 0
    # Usage as of now: the unpin ran no step, and the pinned blocks are free again.
    assert metric(url, "kvpool:kv_cache_usage_perc") == 0


def test_bad_pin_bodies(pinned_server: ServerHandle) -> None:
    url = pinned_server.url
    for body in ({"prompt": []}, {"prompt": [1, 2], "ttl": -1}, {"prompt": "x", "extra": 1}, {"messages": []},
                 {"messages": [{"role": "wizard", "content": "x"}]}):
        assert httpx.post(f"{url}/v1/pins", json=body, headers=KEY).status_code == 400, body
    for body in ({}, {"prompt": "x" * 100, "messages": [{"role": "system", "content": "x"}]}):
        r = httpx.post(f"{url}/v1/pins", json=body, headers=KEY)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "as `prompt` (text or token ids) or as `messages`" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/pins", json={"prompt": [1, 2, 3]}, headers=KEY)  # shorter than a block
    assert r.status_code == 400 and "no full block" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"
    # Longer than the context: what is wrong with it, not that it is over the budget.
    r = httpx.post(f"{url}/v1/pins", json={"prompt": list(range(600))}, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"].startswith("prompt: the prefix has 600 tokens; the context holds 512")
    r = httpx.post(f"{url}/v1/pins", json={"prompt": [1, 10**6] * 16}, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt: token ids must be in")


SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3


def chat(url: str, question: str, **kw: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=KEY, timeout=60, json={
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 2, "temperature": 0, **kw})


def test_a_system_prompt_pinned_by_its_messages(pinned_server: ServerHandle) -> None:
    url = pinned_server.url
    r = httpx.post(f"{url}/v1/pins", json={"messages": [{"role": "system", "content": SYSTEM}], "ttl": 600},
                   headers=KEY, timeout=60)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["num_tokens"] == 32  # the 2 full blocks every chat with this system prompt starts with
    for q in ("Hi!", "What is a KV cache?"):
        assert chat(url, q).json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert httpx.delete(f"{url}/v1/pins/{pin['id']}", headers=KEY).json()["deleted"] is True


def test_standing_pins_are_made_at_start_and_again_after_a_recovery(chat_llama_dir: Path, tmp_path: Path) -> None:
    prompt_file = tmp_path / "system.txt"
    prompt_file.write_text(SYSTEM + "\n")
    args = build_parser().parse_args(["serve", "--pin-system-prompt", f"@{prompt_file}",
                                      "--pin-prefix", "Once upon a time " * 8])
    standing = read_standing_prefixes(args)
    assert standing == [StandingPrefix("Once upon a time " * 8), StandingPrefix(SYSTEM, system_prompt=True)]
    h = start_server(make_engine(chat_llama_dir, num_blocks=64), served_model_name="tiny", api_key="sekrit",
                     pin_prefixes=standing)
    try:
        first = httpx.get(f"{h.url}/v1/pins", headers=KEY).json()["data"]
        assert [(p["num_tokens"], p["expires_in"]) for p in first] == [(32, None), (32, None)]
        assert chat(h.url, "Hi!").json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        fail_first_step(h.engine.engine)
        assert chat(h.url, "Hello?").status_code == 503  # failed in the step; the engine recovered
        again = httpx.get(f"{h.url}/v1/pins", headers=KEY).json()["data"]
        assert [(p["id"], p["num_tokens"], p["expires_in"]) for p in again] == [(p["id"], 32, None) for p in first]
        # The recovery forgot every cached block, yet the system prompt hits: it was computed and pinned again.
        assert chat(h.url, "Hi!").json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        # So does a reset (refused with pins before: their blocks were never free), and a client's pin too.
        r = httpx.post(f"{h.url}/v1/pins", json={"prompt": list(range(1000, 1000 + 16 * 2)), "ttl": 600},
                       headers=KEY, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.post(f"{h.url}/reset_prefix_cache", headers=KEY).json() == {"reset": True}
        after = httpx.get(f"{h.url}/v1/pins", headers=KEY).json()["data"]
        assert [p["id"] for p in after] == [p["id"] for p in first] + [r.json()["id"]]
        assert 590 < after[2]["expires_in"] <= r.json()["expires_in"]
        hit = httpx.post(f"{h.url}/v1/completions", headers=KEY, json={
            "prompt": list(range(1000, 1000 + 16 * 2 + 1)), "max_tokens": 1}).json()
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    finally:
        h.stop()


def test_standing_pins_that_cannot_be_read_name_their_flag(tmp_path: Path) -> None:
    for argv, message in ((["--pin-prefix", f"@{tmp_path}/missing.txt"], "pin_prefix: cannot read"),
                          (["--pin-system-prompt", ""], "pin_system_prompt: '' is empty")):
        with pytest.raises(ValueError, match=f"^{message}"):
            read_standing_prefixes(build_parser().parse_args(["serve", *argv]))
