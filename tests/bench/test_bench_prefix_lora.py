"""`kvpool bench prefix --systems kvpool,kvpool-lora`: the base model alone against random LoRA adapters,
one per group of the shared-prefix workload, run for run in one invocation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli import main


def test_bench_prefix_lora_variant(chat_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "prefix", "--model", str(chat_llama_dir), "--dtype", "float32", "--kv-cache-memory", "64MiB",
               "--systems", "kvpool,kvpool-lora", "--groups", "4", "--system-len", "32", "--questions", "2",
               "--question-len", "8", "--output-len", "3", "--lora", "2", "--lora-rank", "4", "--runs", "2", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    base, lora = result["systems"]["kvpool"], result["systems"]["kvpool-lora"]
    assert lora["hit_rate"] == base["hit_rate"] > 0  # each group's prefix stays within its adapter
    assert result["lora_time_ratio"] == pytest.approx(lora["wall_s"] / base["wall_s"])
    assert "2 LoRA adapters (rank 4, all linear layers) vs the base model alone" in out


def test_bench_prefix_reports_the_cold_first_run(chat_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --no-warmup: the first timed run is the engine's first requests; it is reported against the median.
    rc = main(["bench", "prefix", "--model", str(chat_llama_dir), "--dtype", "float32", "--kv-cache-memory", "64MiB",
               "--systems", "kvpool", "--groups", "2", "--system-len", "32", "--questions", "2",
               "--question-len", "8", "--output-len", "3", "--runs", "3", "--no-warmup", "--json"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["systems"]["kvpool"]
    assert len(s["wall_s_runs"]) == 3
    assert s["first_run_vs_median"] == pytest.approx(s["wall_s_runs"][0] / sorted(s["wall_s_runs"])[1])
    assert s["hit_rate"] > 0


def test_bench_prefix_alternates_the_systems_runs(chat_llama_dir: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Every kvpool system is built first, then the timed runs alternate A B, B A, A B: drift over the
    # invocation (or a process's second engine running slower) weighs on both systems alike.
    from kvpool.bench import prefix

    built: list[int] = []
    ran: list[int] = []
    init, run = prefix.KVPoolSession.__init__, prefix.KVPoolSession.run

    def record_init(self: prefix.KVPoolSession, *args: object, **kw: object) -> None:
        init(self, *args, **kw)  # type: ignore[arg-type]
        built.append(id(self))

    def record_run(self: prefix.KVPoolSession) -> None:
        ran.append(built.index(id(self)))
        run(self)

    monkeypatch.setattr(prefix.KVPoolSession, "__init__", record_init)
    monkeypatch.setattr(prefix.KVPoolSession, "run", record_run)
    rc = main(["bench", "prefix", "--model", str(chat_llama_dir), "--dtype", "float32", "--kv-cache-memory", "64MiB",
               "--systems", "kvpool-no-cache,kvpool", "--groups", "2", "--system-len", "32", "--questions", "2",
               "--question-len", "8", "--output-len", "3", "--runs", "3", "--json"])
    assert rc == 0
    assert ran == [0, 1, 1, 0, 0, 1]
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(result["systems"]) == ["kvpool-no-cache", "kvpool"]  # reported in the order asked for
    assert result["systems"]["kvpool-no-cache"]["hit_rate"] == 0 < result["systems"]["kvpool"]["hit_rate"]
    assert result["outputs_identical_cache_on_off"] is True
    # An unknown system is refused before any engine is built.
    assert main(["bench", "prefix", "--model", str(chat_llama_dir), "--systems", "kvpool,vllm"]) == 2
    assert "kvpool: error: systems: unknown 'vllm'" in capsys.readouterr().err
    assert len(built) == 2
