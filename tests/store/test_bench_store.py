"""`kvpool bench store` on both backends (its own redis-server process): every block read back, one
round trip per batch each way, and a JSON line with the figures."""

from __future__ import annotations

import json

import pytest

from kvpool.cli import main


def test_bench_store(redis_server: object, capsys: pytest.CaptureFixture[str]) -> None:
    # (The fixture only checks that a server binary exists; the benchmark starts its own.)
    rc = main(["bench", "store", "--blocks", "12", "--batch", "4", "--block-bytes", "8192", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("file", "redis"):
        b = res["backends"][name]
        assert b["hits"] == 12 and b["round_trips"] == 6  # 3 writes + 3 reads of 4 blocks
        assert b["bytes_read"] >= 12 * 8192 and b["read_mib_per_s"] > 0
    assert main(["bench", "store", "--backends", "s3"]) == 2
