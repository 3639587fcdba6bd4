"""The bench commands refuse bad flags before they run anything (no model loads, no request is sent): a count
of 0, an empty or unknown list of systems or backends, an unusable length span, a negative or NaN break-even,
a result folder that cannot be written. Each refusal names the flag, with no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.bench import multiturn
from kvpool.bench.report import format_table
from kvpool.cli import build_parser, main


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "store", "--backends", ""], "backends: name at least one of file, redis"),
    (["bench", "store", "--backends", "file,tape"], "backends: unknown 'tape'"),
    (["bench", "prefix", "--systems", ","], "systems: name at least one of kvpool, "),
    (["bench", "multiturn", "--systems", ","], "systems: name at least one of no-cache, "),
    (["bench", "cluster", "--systems", ","], "systems: name at least one of round-robin, "),
    # (an engine flag the bench would override: refused, not ignored)
    (["bench", "prefix", "--no-prefix-caching", "--groups", "1", "--questions", "1", "--system-len", "16",
      "--question-len", "4", "--output-len", "1", "--no-warmup"],
     "--no-prefix-caching: not a bench prefix flag; run --systems kvpool-no-cache"),
    (["bench", "multiturn", "--no-prefix-caching"], "--no-prefix-caching: not a bench multiturn flag; run --systems "
                                                    "no-cache"),
    (["bench", "multiturn", "--swap-space", "64MiB"], "--swap-space: not a bench multiturn flag; the device+host "
                                                      "systems take --host-blocks"),
    (["bench", "multiturn", "--write-through"], "--write-through: not a bench multiturn flag"),
    (["bench", "manager", "--block-size", "0", "--repeats", "1"], "block_size: must be >= 1, got 0"),
    (["bench", "manager", "--repeats", "0"], "repeats: must be >= 1, got 0"),
    (["bench", "store", "--backends", "file", "--redis-url", "redis://127.0.0.1:9"],
     "redis_url: only the redis backend reads it"),
    (["bench", "store", "--backends", "redis", "--redis-url", "redis://127.0.0.1:9", "--blocks", "2"],
     "store: cannot reach redis://127.0.0.1:9"),
    (["bench", "serve", "--model", "m", "--base-url", "http://127.0.0.1:99999", "--num-prompts", "1"],
     "base_url: 'http://127.0.0.1:99999' has no valid port"),
    (["bench", "serve", "--model", "m", "--burstiness", "inf", "--num-prompts", "1"],
     "burstiness: must be a finite number > 0, got inf"),
    (["bench", "serve", "--model", "m", "--dataset-path", "/nonexistent", "--num-prompts", "1"],
     "dataset_path: only the trace dataset reads a file; --dataset-name random would ignore it"),
    (["bench", "memory", "--contexts", ""], "contexts: comma-separated integers expected, got ''"),
])
def test_an_empty_or_unknown_list_is_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    assert main(argv) == 2
    assert f"kvpool: error: {message}" in capsys.readouterr().err


def test_multiturn_checks_every_system_before_running_one(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []
    monkeypatch.setattr(multiturn, "run_system", lambda n, *_: ran.append(n) or ({}, []))
    assert main(["bench", "multiturn", "--systems", "device,bogus:bfloat16"]) == 2
    assert "kvpool: error: systems: unknown 'bogus:bfloat16'" in capsys.readouterr().err
    assert ran == []  # the `device` system did not run first


@pytest.mark.parametrize(("argv", "flag"), [
    (["bench", "prefix", "--runs", "0"], "--runs"),
    (["bench", "prefix", "--groups", "0"], "--groups"),
    (["bench", "prefix", "--questions", "0"], "--questions"),
    (["bench", "prefix", "--system-len", "0"], "--system-len"),
    (["bench", "prefix", "--hf-batch-size", "0"], "--hf-batch-size"),
    (["bench", "multiturn", "--concurrency", "0"], "--concurrency"),
    (["bench", "multiturn", "--turns", "0"], "--turns"),
    (["bench", "multiturn", "--conversations", "0"], "--conversations"),
    (["bench", "multiturn", "--user-len", "x"], "--user-len"),
    (["bench", "multiturn", "--answer-len", "9:3"], "--answer-len"),
    (["bench", "cluster", "--user-len", "0:4"], "--user-len"),
    (["bench", "cluster", "--concurrency", "0"], "--concurrency"),
    (["bench", "store", "--recompute-ms-per-block", "-5"], "--recompute-ms-per-block"),
    (["bench", "store", "--recompute-ms-per-block", "nan"], "--recompute-ms-per-block"),
    (["bench", "store", "--blocks", "0"], "--blocks"),
    (["bench", "cluster", "--device-blocks", "0"], "--device-blocks"),
    (["bench", "cluster", "--host-blocks", "-1"], "--host-blocks"),
    (["bench", "cluster", "--threads", "0"], "--threads"),
    (["bench", "cluster", "--system-len", "-5"], "--system-len"),
    (["bench", "multiturn", "--device-blocks", "1"], "--device-blocks"),
    (["bench", "multiturn", "--host-blocks", "0"], "--host-blocks"),
    (["bench", "multiturn", "--system-len", "-5"], "--system-len"),
    (["bench", "serve", "--port", "70000"], "--port"),
])
def test_a_bad_count_is_refused_as_it_is_parsed(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
                                                ) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_good_spans_and_counts_parse() -> None:
    a = build_parser().parse_args(["bench", "multiturn", "--user-len", "8", "--answer-len", "4:6", "--turns", "2"])
    assert (a.user_len, a.answer_len, a.turns) == ("8", "4:6", 2)
    a = build_parser().parse_args(["bench", "store", "--recompute-ms-per-block", "0.5"])
    assert a.recompute_ms_per_block == 0.5


@pytest.mark.parametrize("where", ["missing", "a file"])
def test_bench_serve_checks_the_result_dir_before_the_load_test(where: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Found after the load test, a bad folder lost the result; nothing listens on port 9 here, and the
    refusal comes before any request is sent."""
    target = tmp_path / "nope"
    if where == "a file":
        target.write_text("")
    assert main(["bench", "serve", "--port", "9", "--num-prompts", "1", "--save-result",
                 "--result-dir", str(target)]) == 2
    assert f"kvpool: error: result_dir: {str(target)!r} is not a directory" in capsys.readouterr().err


def test_a_table_may_have_no_rows() -> None:
    assert format_table(["a", "bee"], []).splitlines() == ["a  bee", "-  ---"]
