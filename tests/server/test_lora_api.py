"""LoRA adapters behind the HTTP server: `--lora-modules` adapters listed by /v1/models (with the base model
as `parent`), chosen by a request's `model`, 404 for an unknown one, bad adapters refused at start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import make_peft_adapter, peft_greedy
from server_helpers import make_engine

from kvpool.cli import main
from kvpool.server.serve import ServerHandle, add_lora_modules, start_server

PROMPT = [(37 * i + 11) % 4000 + 100 for i in range(40)]  # token ids: 2 full blocks of 16 and more
N_OUT = 8


@pytest.fixture(scope="module")
def adapters(chat_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-loras")
    return {"sql": make_peft_adapter(chat_llama_dir, root / "sql", r=8, targets=["q_proj", "v_proj"], seed=1),
            "chat": make_peft_adapter(chat_llama_dir, root / "chat", r=16, targets="all-linear", seed=2)}


@pytest.fixture(scope="module")
def lora_server(chat_llama_dir: Path, adapters: dict[str, Path]) -> Iterator[ServerHandle]:
    engine = make_engine(chat_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16)
    add_lora_modules(engine, [f"{name}={path}" for name, path in adapters.items()])
    h = start_server(engine, served_model_name="tiny")
    yield h
    h.stop()


def complete(url: str, model: str, prompt: list[int] = PROMPT) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": N_OUT,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)


def test_models_lists_the_adapters(lora_server: ServerHandle, adapters: dict[str, Path]) -> None:
    data = httpx.get(f"{lora_server.url}/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny", "sql", "chat"]
    assert data[0]["parent"] is None
    for m in data[1:]:
        assert m["parent"] == "tiny" and m["root"] == str(adapters[m["id"]]) and m["object"] == "model"


def test_unknown_adapter_is_404(lora_server: ServerHandle) -> None:
    for route, body in (("completions", {"prompt": "hi"}), ("chat/completions",
                                                            {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{lora_server.url}/v1/{route}", json={"model": "sqll", **body})
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["param"] == "model" and err["code"] == 404 and err["type"] == "not_found_error"
        assert "`sqll` does not exist" in err["message"] and "`sql`" in err["message"]


def test_a_request_by_adapter_name_runs_that_adapter(lora_server: ServerHandle, chat_llama_dir: Path,
                                                     adapters: dict[str, Path]) -> None:
    tok = lora_server.engine.engine.tokenizer
    texts = {}
    for name in ("tiny", "sql", "chat"):
        want = peft_greedy(chat_llama_dir, adapters.get(name), [PROMPT], N_OUT)[0]
        first, again = complete(lora_server.url, name), complete(lora_server.url, name)
        for r in (first, again):
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == name
            assert body["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
        # Prefix caching per adapter: the repeat hits its own blocks; the first of each adapter hit nothing
        # (the prompt was computed before, but under another adapter).
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        texts[name] = first.json()["choices"][0]["text"]
    assert len(set(texts.values())) == 3  # each adapter changes the text
    r = httpx.post(f"{lora_server.url}/v1/chat/completions", timeout=60,
                   json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == "chat"


def test_serve_refuses_a_bad_adapter_at_start(chat_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    base = ["serve", "--model", str(chat_llama_dir), "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--port", "0"]
    assert main([*base, "--lora-modules", f"sql={adapters['sql']}", f"gone={tmp_path / 'nope'}"]) == 2
    assert "kvpool: error: lora_request: adapter 'gone'" in capsys.readouterr().err
    big = ["--lora-modules", f"chat={adapters['chat']}", "--max-lora-rank", "8"]
    assert main([*base, *big]) == 2
    assert "rank 16" in capsys.readouterr().err
    assert main([*base, "--lora-modules", "noequals"]) == 2
    assert "lora_modules" in capsys.readouterr().err
    assert main([*base, "--served-model-name", "sql", "--lora-modules", f"sql={adapters['sql']}"]) == 2
    assert "is the served model's name" in capsys.readouterr().err
