"""A chat template in place of the model's: `--chat-template` (a file or the text) for a model without one,
`LLM.chat(chat_template=...)` for one call, and a request's own `chat_template` on a server started with
--trust-request-chat-template (vLLM's flags)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from helpers import make_tiny_llama
from server_helpers import make_engine

from kvpool import LLM, SamplingParams
from kvpool.server.serve import start_server

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "user", "content": "Name a color."}]
RENDERED = "[user] Name a color.\n[assistant] "


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    """A tiny model with SmolLM2's tokenizer and no chat template (as Gemma-3 270M's GGUF comes)."""
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-no-template"), seed=1, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, path / name)
    return path


def test_a_model_without_a_template_takes_one_from_a_file_or_its_text(bare_dir: Path, tmp_path: Path) -> None:
    kw = dict(dtype="float32", num_blocks=32, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"messages: this model has no chat template \(give one: --chat-template"):
        LLM(str(bare_dir), **kw).chat(MESSAGES, SamplingParams.greedy(1), use_tqdm=False)
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    for given in (str(file), TEMPLATE):
        llm = LLM(str(bare_dir), chat_template=given, **kw)
        out = llm.chat(MESSAGES, SamplingParams.greedy(2), use_tqdm=False)[0]
        assert out.prompt_token_ids == llm.engine.encode(RENDERED)
    with pytest.raises(ValueError, match=r"chat_template: '/no/such/template\.jinja' is not a file, nor a template"):
        LLM(str(bare_dir), chat_template="/no/such/template.jinja", **kw)
    with pytest.raises(ValueError, match="chat_template: renders chats with the tokenizer, and skip_tokenizer_init"):
        LLM(str(bare_dir), chat_template=TEMPLATE, skip_tokenizer_init=True, **kw)
    empty, latin = tmp_path / "empty.jinja", tmp_path / "latin.jinja"
    empty.write_text("  \n")
    latin.write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    with pytest.raises(ValueError, match="chat_template: the file is empty"):
        LLM(str(bare_dir), chat_template=str(empty), **kw)
    with pytest.raises(ValueError, match=r"chat_template: .* cannot be read as UTF-8 text"):
        LLM(str(bare_dir), chat_template=str(latin), **kw)


def test_llm_chat_takes_a_template_for_one_call(chat_llama_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(chat_llama_dir), dtype="float32", num_blocks=32, block_size=4, max_model_len=64)
    own = llm.chat(MESSAGES, SamplingParams.greedy(1), use_tqdm=False)[0].prompt_token_ids
    given = llm.chat(MESSAGES, SamplingParams.greedy(1), use_tqdm=False, chat_template=TEMPLATE)[0]
    assert given.prompt_token_ids == llm.engine.encode(RENDERED) != own
    # A file's path is read, as --chat-template reads it (not rendered as the prompt's text).
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    assert llm.chat(MESSAGES, SamplingParams.greedy(1), use_tqdm=False, chat_template=str(file))[0] \
        .prompt_token_ids == given.prompt_token_ids
    # (the model's own again on the next call)
    assert llm.chat(MESSAGES, SamplingParams.greedy(1), use_tqdm=False)[0].prompt_token_ids == own


def test_a_trusting_server_renders_the_requests_own_template(bare_dir: Path) -> None:
    engine = make_engine(bare_dir)
    h = start_server(engine, served_model_name="tiny", trust_request_chat_template=True)
    try:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                "chat_template": TEMPLATE, "return_token_ids": True}
        r = httpx.post(f"{h.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["prompt_token_ids"] == engine.encode(RENDERED), r.text
        tok = httpx.post(f"{h.url}/tokenize", json={"messages": MESSAGES, "chat_template": TEMPLATE}, timeout=60)
        assert tok.json()["tokens"] == engine.encode(RENDERED)
        # Without a template of the request's or the model's: the 400 says how to give one.
        r = httpx.post(f"{h.url}/v1/chat/completions", json={**body, "chat_template": None}, timeout=60)
        assert r.status_code == 400 and "this model has no chat template" in r.json()["error"]["message"]
        # A template that fails while rendering: a 400 naming the messages, never a 500.
        bad = {**body, "chat_template": "{{ raise_exception('no system messages') }}"}
        r = httpx.post(f"{h.url}/v1/chat/completions", json=bad, timeout=60)
        assert r.status_code == 400 and "no system messages" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{h.url}/v1/chat/completions", json={**body, "chat_template": "{% for %}"}, timeout=60)
        assert r.status_code == 400, r.text
        # A short template that renders far more than any prompt: refused before the text is encoded (the
        # tokenizer's lock, which every running stream's detokenizing needs, is never held for it).
        huge = {**body, "chat_template": "{{ 'ab ' * 3000000 }}"}
        r = httpx.post(f"{h.url}/v1/chat/completions", json=huge, timeout=60)
        assert r.status_code == 400 and "the chat renders to 9000000 characters" in r.json()["error"]["message"]
    finally:
        h.stop()
