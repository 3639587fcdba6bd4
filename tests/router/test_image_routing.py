"""Chats with pictures through the router, to two real image-model replicas (the tiny chat Mllama, with KV
events): replicas hash a picture by its processed pixels, which the router cannot reproduce, so it keys such
a chat by its text salted with a digest of its pictures (`RouteKey.sticky`). A conversation's later turns,
which carry the same picture, go to the replica that cached the earlier ones and hit its cache there; a chat
with the same words and another picture shares nothing and is not drawn there by them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import data_url
from helpers import picture as image
from replicas import start_front, start_replica

from kvpool.router.app import RouterHandle, load_tokenizer
from kvpool.server.serve import ServerHandle


def picture(seed: int) -> str:
    return data_url(image(seed))


@pytest.fixture(scope="module")
def pair(chat_mllama_dir: Path) -> Iterator[tuple[RouterHandle, list[ServerHandle]]]:
    reps = [start_replica(chat_mllama_dir) for _ in range(2)]
    # What was routed lately (pending_ttl_s) is forgotten at once: only the events and the sticky keys route.
    front = start_front([s for _, s in reps], load_tokenizer(str(chat_mllama_dir)), pending_ttl_s=0.01)
    yield front, [h for h, _ in reps]
    front.stop()
    for h, _ in reps:
        h.stop()


def ask(url: str, messages: list[dict[str, Any]]) -> httpx.Response:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def turn(pic: str, question: str) -> dict[str, Any]:
    # The picture first: the text before it is less than a block, so the replicas' events alone (whose
    # hashes past the picture the router cannot compute) would not tell where the conversation lives.
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": pic}},
                                        {"type": "text", "text": question}]}


def test_later_turns_with_the_same_picture_follow_the_cache(pair: tuple[RouterHandle, list[ServerHandle]]) -> None:
    front, _ = pair
    question = "What is in this picture? Describe every part of it, slowly. " * 3
    first = [turn(picture(1), question)]
    r1 = ask(front.url, first)
    home = r1.headers["x-kvpool-replica"]
    convo = [*first, {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And its colours?"}]
    time.sleep(0.05)
    names = list(front.router.replicas)
    front.router._rr = names.index(next(n for n in names if n != home)) - 1  # ties would go to the other one
    r = ask(front.url, convo)
    assert r.headers["x-kvpool-replica"] == home
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 16
    # The same words with another picture: no sticky match anywhere, so each replica is as good as the other.
    before = front.router.metrics.matched_blocks._value.get()
    other = [turn(picture(2), question)]
    ask(front.url, other)
    assert front.router.metrics.matched_blocks._value.get() == before
