"""Fixtures of the store tests: a real redis-server process on a free loopback port."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvpool.store.server import RedisServer, find_server_binary


def _binary() -> str:
    binary = find_server_binary()
    if binary is None:
        msg = "no redis-server or valkey-server on PATH (scripts/install.sh installs Debian's redis-server)"
        if os.environ.get("CI"):
            pytest.fail(msg)  # CI's install must provide it: a skip there would hide a broken install
        pytest.skip(msg)
    return binary


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh server per test (tests kill it)."""
    srv = RedisServer(_binary()).start()
    yield srv
    srv.stop()
