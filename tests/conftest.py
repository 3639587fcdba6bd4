"""Fixtures shared by every test folder: the word tokenizer of the seeds' examples and the model folders
(a tiny random-weight Llama, the real SmolLM2 converted once, a tiny Llama with SmolLM2's tokenizer)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import Words, make_chat_mllama, make_tiny_llama

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def words() -> Words:
    return Words()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    from kvpool.runner.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def chat_llama_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    """A tiny random-weight Llama wearing SmolLM2's tokenizer and chat template: real tokenization and
    chat formatting, millisecond forwards."""
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-chat-llama"), seed=1, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smol_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def chat_mllama_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    """A tiny random-weight Mllama with a tokenizer, a chat template and an image processor: images over HTTP."""
    return make_chat_mllama(tmp_path_factory.mktemp("tiny-chat-mllama"), smol_dir)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one picture (cat.png), for file:// image URLs, and a symbolic link to itself (loop)."""
    from helpers import picture

    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(picture(7))
    (d / "loop").symlink_to(d / "loop")
    return d
