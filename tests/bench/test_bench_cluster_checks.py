"""`kvpool bench cluster` without a model: a failed request fails the run at once (it used to hang), the store
flag is checked before any replica starts, the p99 is the other benchmarks' percentile, and the JSON's
config holds the benchmark's flags only."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvpool.bench import cluster
from kvpool.bench.report import BenchFailed, percentile
from kvpool.cli import build_parser, main


@pytest.fixture
def failing_server() -> Iterator[str]:
    """The first request gets HTTP 400 at once; every later one is held until the test ends (a request
    still in flight when the run fails). Yields the server's URL."""
    release = threading.Event()
    seen: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append(1)
            if len(seen) > 1:
                release.wait(30)
            self.send_response(400)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error":{"message":"bad"}}')

        def log_message(self, *_: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()


def test_a_failed_request_fails_the_run_at_once(failing_server: str) -> None:
    """It used to hang forever: the failed task left the set of tasks before its exception was looked at."""
    url = failing_server
    a = argparse.Namespace(conversations=3, turns=2, concurrency=2, seed=0, system_len=8, user_len="4:4",
                           answer_len="2:2")
    system, convs = cluster.conversations(a)

    async def go() -> None:
        # (the other request in flight is held for 30 s: cancelled, it does not keep the run waiting)
        await asyncio.wait_for(cluster.drive(url, a, system, convs), 10)

    t0 = time.monotonic()
    with pytest.raises(BenchFailed, match=r"^conversation \d+ turn 0: HTTP 400 "):
        asyncio.run(go())
    assert time.monotonic() - t0 < 8


def test_p99_is_the_shared_percentile_not_the_largest() -> None:
    xs = [0.1] * 31 + [5.0]
    res = [{"conv": i, "turn": i % 2, "ttft": x, "text": "", "replica": "u", "prompt_tokens": 10, "cached_tokens": 0,
            "completion_tokens": 1} for i, x in enumerate(xs)]
    s = cluster.summarize({"wall_s": 1.0, "results": res}, None, 0.0, 0.0, ["u"])
    assert s["ttft_p99_ms"] == pytest.approx(1e3 * percentile(xs, 99))
    assert s["ttft_p99_ms"] < 1e3 * max(xs)
    later = [x for i, x in enumerate(xs) if i % 2]
    assert s["ttft_p99_ms_later_turns"] == pytest.approx(1e3 * percentile(later, 99))


def test_the_config_holds_the_benchmarks_flags_only() -> None:
    a = build_parser().parse_args(["-v", "bench", "cluster", "--conversations", "3"])
    cfg = cluster.config_of(a)
    assert not {"run", "with_engine", "command", "verbose", "func"} & set(cfg)
    assert cfg["conversations"] == 3 and "systems" in cfg
    json.dumps(cfg)


class FakeReplica:
    def __init__(self, *_: Any, **__: Any) -> None:
        self.url = f"http://replica-{id(self)}"

    def wait(self) -> None:
        pass

    def stop(self) -> None:
        pass


async def fake_drive(url: str, a: argparse.Namespace, system: list[int], convs: list[list[tuple]],
                     salt_each: bool = False) -> dict[str, Any]:
    res = [{"conv": c, "turn": t, "ttft": 0.01 * (t + 1), "text": "x", "replica": url, "prompt_tokens": 10,
            "cached_tokens": 0 if salt_each else 5, "completion_tokens": 2}
           for c in range(len(convs)) for t in range(len(convs[c]))]
    return {"wall_s": 1.0, "results": res}


def test_the_json_reports_the_benchmarks_flags_and_no_empty_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The run itself faked (no process, no request): `config` had the command line's own fields, and
    `skipped` was an empty object no code filled."""
    import kvpool.runner.model_files as model_files

    monkeypatch.setattr(model_files, "resolve_model", lambda _: tmp_path)
    monkeypatch.setattr(cluster, "Replica", FakeReplica)
    monkeypatch.setattr(cluster, "drive", fake_drive)
    monkeypatch.setattr(cluster, "_run_system", lambda name, a, system, convs, reference, targets: cluster.summarize(
        asyncio.run(fake_drive(targets[0].url, a, system, convs)), reference, 0.0, 0.0, [t.url for t in targets]))
    assert main(["-v", "bench", "cluster", "--conversations", "2", "--turns", "2", "--systems",
                 "round-robin,ceiling", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(res["systems"]) == {"round-robin", "ceiling"}
    assert not {"run", "with_engine", "command", "verbose", "func"} & set(res["config"])
    assert res["config"]["conversations"] == 2
    assert "skipped" not in res


@pytest.mark.parametrize(("argv", "message"), [
    # (without a +store system, the store would be ignored)
    (["--kv-store", "redis://127.0.0.1:9"], "--kv-store: only the +store systems use a store"),
    (["--kv-store", "bogus://x", "--systems", "router+store"], "kv_store: unknown scheme 'bogus'"),
    (["--kv-store", "nourl", "--systems", "router,router+store"], "kv_store: 'nourl' is not a URL"),
    (["--kv-store", "redis://127.0.0.1:9", "--systems", "round-robin+store"], "kv_store: cannot reach "
                                                                               "redis://127.0.0.1:9"),
])
def test_the_store_flag_is_checked_before_any_replica_starts(argv: list[str], message: str,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    def no_replica(*_: Any, **__: Any) -> None:
        raise AssertionError("a replica started")

    monkeypatch.setattr(cluster, "Replica", no_replica)
    assert main(["bench", "cluster", *argv]) == 2
    assert f"kvpool: error: {message}" in capsys.readouterr().err


def test_a_reachable_file_store_passes_the_check(tmp_path: Path) -> None:
    cluster.check_store(f"file://{tmp_path}/store", ["router", "router+store"])


def test_a_run_that_cannot_finish_is_one_line_and_exit_1(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def fail(a: argparse.Namespace) -> None:
        raise BenchFailed("conversation 3 turn 1: HTTP 503 from http://127.0.0.1:9: b'busy'")

    monkeypatch.setattr(cluster, "run", fail)
    assert main(["bench", "cluster"]) == 1
    err = capsys.readouterr().err
    assert err == "kvpool: error: conversation 3 turn 1: HTTP 503 from http://127.0.0.1:9: b'busy'\n"
