"""`add_special_tokens` on /v1/completions, with a tokenizer that adds a BOS token (SmolLM2's adds none, so the
tiny chat Llama wears a copy of it whose post-processor puts `<|endoftext|>` first)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import make_engine

from kvpool.server.serve import ServerHandle, start_server

BOS = 0  # <|endoftext|>


@pytest.fixture(scope="module")
def bos_server(chat_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    d = tmp_path_factory.mktemp("tiny-bos")
    for f in chat_llama_dir.iterdir():
        shutil.copy(f, d / f.name)
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
                             "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [BOS],
                                                                  "tokens": ["<|endoftext|>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    h = start_server(make_engine(d), served_model_name="tiny")
    yield h
    h.stop()


def test_add_special_tokens_false_leaves_the_bos_token_out(bos_server: ServerHandle) -> None:
    url = f"{bos_server.url}/v1/completions"
    body = {"prompt": "Hello world", "max_tokens": 3, "temperature": 0}
    with_bos = httpx.post(url, json=body).json()
    without = httpx.post(url, json={**body, "add_special_tokens": False}).json()
    ids = httpx.post(f"{bos_server.url}/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert ids[0] == BOS
    assert with_bos["usage"]["prompt_tokens"] == len(ids) and without["usage"]["prompt_tokens"] == len(ids) - 1
    by_ids = httpx.post(url, json={**body, "prompt": ids[1:]}).json()
    assert without["choices"][0]["text"] == by_ids["choices"][0]["text"]
    batch = httpx.post(url, json={**body, "prompt": ["Hello world", "Hi"], "add_special_tokens": False}).json()
    assert batch["choices"][0]["text"] == by_ids["choices"][0]["text"]
    chat = httpx.post(f"{bos_server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "add_special_tokens": True})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "add_special_tokens"
