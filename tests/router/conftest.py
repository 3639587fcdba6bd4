"""Fixtures of the router tests: kvpool replicas on the tiny chat Llama, served for real on 127.0.0.1,
each publishing KV events (PUB + replay), and the tokenizer the router needs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))


@pytest.fixture(scope="session")
def chat_tokenizer(chat_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_llama_dir))
