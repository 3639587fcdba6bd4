"""The server fixture: the tiny chat Llama (`chat_llama_dir` in tests/conftest.py) served for real on
127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import make_engine

from kvpool.server.serve import ServerHandle, start_server


@pytest.fixture(scope="module")
def server(chat_llama_dir: Path) -> Iterator[ServerHandle]:
    h = start_server(make_engine(chat_llama_dir), served_model_name="tiny", max_body_bytes=64 << 10)
    yield h
    h.stop()
