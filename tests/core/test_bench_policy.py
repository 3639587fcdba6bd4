"""`kvpool bench policy`: its JSON contract, the gap to Belady, the plot, and the default traces."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.bench import policy as bench_policy
from kvpool.bench.workloads import shared_prefix_trace, write_trace


def test_json_contract_table_and_plot(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, shared_prefix_trace(120, seed=3, n_systems=6, sys_max=400, prompt_max=512))
    png = tmp_path / "hit.png"
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "policy", "--trace", str(trace),
                          "--num-blocks", "160", "320", "--concurrency", "2", "--policies", "lru,slru,reuse",
                          "--json", "--plot", str(png)], capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    res = json.loads(lines[-1])["results"]
    assert [(r["num_blocks"], r["policy"]) for r in res] == [
        (160, "lru"), (160, "slru"), (160, "reuse"), (320, "lru"), (320, "slru"), (320, "reuse")]
    for r in res:
        assert r["trace"] == "t.jsonl" and r["concurrency"] == 2 and r["requests_per_s"] > 0
        assert 0 < r["hit_rate"] <= r["belady_hit_rate"] + 1e-12 < 1
    lru = res[0]
    assert lru["gap_closed"] == 0.0
    other = res[1]
    assert other["gap_closed"] == pytest.approx(
        (other["hit_rate"] - lru["hit_rate"]) / (lru["belady_hit_rate"] - lru["hit_rate"]))
    assert lines[0].split()[:4] == ["trace", "blocks", "conc", "policy"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_with_a_host_tier_belady_holds_both_tiers_and_same_named_files_stay_apart(tmp_path: Path) -> None:
    """A device-only optimum sat far below what LRU reached with a host tier behind it; two trace files of
    one name were one row and one plot panel."""
    for d in ("x", "y"):
        (tmp_path / d).mkdir()
        write_trace(tmp_path / d / "t.jsonl", shared_prefix_trace(60, seed=ord(d), n_systems=6, sys_max=400,
                                                                 prompt_max=512, decode_len=8))
    p = argparse.ArgumentParser()
    bench_policy.add_arguments(p)
    a = p.parse_args(["--trace", str(tmp_path / "x" / "t.jsonl"), "--trace", str(tmp_path / "y" / "t.jsonl"),
                      "--num-blocks", "80", "--concurrency", "2", "--policies", "lru,slru", "--host-blocks", "800"])
    res = bench_policy.run(a)["results"]
    assert {r["trace"] for r in res} == {str(tmp_path / "x" / "t.jsonl"), str(tmp_path / "y" / "t.jsonl")}
    for r in res:
        assert r["hit_rate"] <= r["belady_hit_rate"] + 1e-12, r


def test_unknown_policy_is_refused() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "policy", "--trace", "multi-turn",
                          "--policies", "lru,mru"], capture_output=True, text=True)
    assert out.returncode == 2 and "--policies: 'mru' is not one of" in out.stderr


def test_default_traces_and_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without --trace: the three standard traces at the sizes and concurrencies of the targets.
    monkeypatch.setattr(bench_policy, "named_trace", lambda name, block_size: [])
    monkeypatch.setattr(bench_policy, "shared_dir", lambda: Path(__file__).parent)  # no Mooncake here
    a = argparse.Namespace(trace=None, num_blocks=None, concurrency=None, block_size=16)
    got = [(c.name, c.num_blocks, c.concurrency) for c in bench_policy.cases(a)]
    assert got == [("multi-turn", [1024, 2048], 4), ("shared-prefix", [1024, 2048], 4)]
    if (Path(__file__).resolve().parents[2].parent / "shared" / "peers" / "traces").exists():
        monkeypatch.undo()
        monkeypatch.setattr(bench_policy, "named_trace", lambda name, block_size: [])
        got = [(c.name, c.num_blocks, c.concurrency) for c in bench_policy.cases(a)]
        assert got[-1] == ("mooncake", [2048, 8192], 16)


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "policy", "--trace", "multi-turn", "--concurrency", "-3"], "concurrency: must be >= 1, got -3"),
    (["bench", "policy", "--trace", "multi-turn", "--policies", ","], "policies: name at least one of"),
    (["bench", "policy", "--trace", "multi-turn", "--num-blocks", "0"], "num_blocks: every pool size must be >= 2"),
    (["bench", "manager", "--num-blocks", "0"], "num_blocks: must be >= 2, got 0"),
    (["bench", "manager", "--trace", "."], "Is a directory"),
    (["bench", "policy", "--trace", "multi-turn", "--plot", "/nonexistent-dir/x.png"], "plot: cannot write into"),
    (["bench", "policy", "--trace", "multi-turn", "--plot", "out"], "plot: 'out' must name a .png file"),
    (["bench", "memory", "--models", ","], "models: name at least one of"),
])
def test_bad_bench_arguments_are_one_line_errors(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.cli import main

    assert main(argv) == 2  # refused before any replay (a negative concurrency used to loop forever)
    assert message in capsys.readouterr().err


def test_ttft_per_turn_is_drawn(tmp_path: Path) -> None:
    from PIL import Image

    from kvpool.bench.plots import ttft_per_turn

    png = tmp_path / "ttft.png"
    ttft_per_turn(str(png), {"device": {"ttft_mean_ms_by_turn": {0: 900.0, 1: 300.0}},
                             "no-cache": {"ttft_mean_ms_by_turn": {"0": 950.0, "1": 1100.0}}})
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size[0] > 400


def test_belady_is_over_the_requests_the_policy_replayed(tmp_path: Path) -> None:
    """Half the prompts fit the device and host pools together but not the device alone: the policies' replays
    skip them, and Belady (device + host as one pool) counted them, 0.91 against the 0.81 of the same
    requests. Now both are over the requests replayed: here, one at a time on the same pool, exactly equal."""
    import random

    from kvpool.bench import manager as bench_manager
    from kvpool.bench.belady import belady_hit_rate

    rng = random.Random(0)
    system, big = [rng.randrange(1000) for _ in range(48)], [rng.randrange(1000) for _ in range(160)]
    trace = [dict(id=f"r{i}", prompt=[*big, rng.randrange(1000)] if i % 2 else
                  [*system, *(rng.randrange(1000) for _ in range(8))], decode=[1]) for i in range(40)]
    write_trace(tmp_path / "t.jsonl", trace)
    p = argparse.ArgumentParser()
    bench_policy.add_arguments(p)
    args = ["--trace", str(tmp_path / "t.jsonl"), "--num-blocks", "6", "--host-blocks", "16", "--concurrency", "1"]
    (row,) = bench_policy.run(p.parse_args([*args, "--policies", "lru"]))["results"]
    assert row["skipped"] == 20
    assert row["belady_hit_rate"] == row["hit_rate"] == belady_hit_rate(trace[::2], 22, 16, 1) != \
        belady_hit_rate(trace, 22, 16, 1)
    m = argparse.ArgumentParser()
    bench_manager.add_arguments(m)
    out = bench_manager.run(m.parse_args([*args, "--repeats", "1"]))
    assert out["belady_hit_rate"] == out["hit_rate"] == row["hit_rate"]
