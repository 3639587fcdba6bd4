"""vLLM's /tokenize and /detokenize on `kvpool serve`: the token ids a prompt or a chat is served as (the
ids a completion request for it would run), and their text; bad input a 400 naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvpool.server.serve import ServerHandle

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def post(server: ServerHandle, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_a_prompt_and_a_chat_are_the_ids_a_request_runs(server: ServerHandle) -> None:
    eng = server.engine.engine
    prompt = "The quick brown fox, naïvely 😀"
    r = post(server, "/tokenize", {"model": "tiny", "prompt": prompt, "return_token_strs": True}).json()
    assert r["tokens"] == eng.encode(prompt) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == eng.max_model_len
    assert r["token_strs"] == eng.tokenizer.convert_ids_to_tokens(r["tokens"])
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": prompt}  # a round trip
    chat = post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat["tokens"] == eng.apply_chat_template(CHAT) and chat["token_strs"] is None
    bare = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert bare == eng.apply_chat_template(CHAT, add_generation_prompt=False) and bare != chat["tokens"]
    # The ids a completion request runs: its prompt token count is theirs.
    usage = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == r["count"]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_bos": True}, "add_bos"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}]}, "messages[0].content[0].image_url"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(server: ServerHandle, path: str, body: dict, field: str) -> None:
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == field, err
