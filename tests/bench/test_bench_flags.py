"""The bench commands refuse bad flags before they run anything (no model loads, no request is sent): a count
of 0, an empty or unknown list of systems or backends, an unusable length span, a negative or NaN break-even,
a result folder that cannot be written. Each refusal names the flag, with no traceback."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from kvpool.bench import multiturn, prefix
from kvpool.bench.plots import plot_path
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
    (["bench", "store", "--backends", "redis", "--redis-url", "bogus", "--blocks", "2"],
     "redis_url: 'bogus' is not a URL"),
    (["bench", "serve", "--model", "m", "--base-url", "http://127.0.0.1:99999", "--num-prompts", "1"],
     "base_url: 'http://127.0.0.1:99999' has no valid port"),
    (["bench", "serve", "--model", "m", "--burstiness", "inf", "--num-prompts", "1"],
     "burstiness: must be a finite number > 0, got inf"),
    (["bench", "serve", "--model", "m", "--dataset-path", "/nonexistent", "--num-prompts", "1"],
     "dataset_path: only the trace dataset reads a file; --dataset-name random would ignore it"),
    (["bench", "memory", "--contexts", ""], "contexts: comma-separated integers expected, got ''"),
    # A flag the command would ignore, as given: refused, not ignored.
    (["bench", "manager", "--requests", "20", "--repeats", "1", "--no-belady", "--host-eviction", "arc"],
     "host_eviction: 'arc' orders the host tier, and there is none (set --host-blocks)"),
    (["bench", "policy", "--trace", "shared-prefix", "--num-blocks", "64", "--policies", "lru", "--no-belady",
      "--host-eviction", "arc"], "host_eviction: 'arc' orders the host tier, and there is none (set --host-blocks)"),
    (["bench", "manager", "--workload", "multi-turn", "--requests", "50", "--repeats", "1", "--no-belady"],
     "requests: the size of the shared-prefix workload; --workload multi-turn has its own"),
    (["bench", "store", "--backends", "redis", "--redis-url", "redis://127.0.0.1:9", "--blocks", "2", "--dir", "/tmp"],
     "dir: only the file backend reads it; add file to --backends"),
    (["bench", "serve", "--model", "m", "--port", "9", "--num-prompts", "1", "--result-filename", "r.json"],
     "result_filename: only read with --save-result, which is not given"),
    (["bench", "serve", "--model", "m", "--port", "9", "--num-prompts", "1", "--result-dir", "/tmp"],
     "result_dir: only read with --save-result, which is not given"),
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
    assert main(["bench", "multiturn", "--systems", "no-cache,device:int8"]) == 2
    assert "kvpool: error: systems: 'device:int8': unknown KV cache dtype 'int8'" in capsys.readouterr().err
    assert main(["bench", "multiturn", "--systems", "device,no-cache@lhd"]) == 2
    assert "kvpool: error: systems: 'no-cache@lhd': no-cache keeps no blocks to evict" in capsys.readouterr().err
    assert ran == []


def test_multiturn_gives_the_store_to_the_host_tier_systems_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-store goes to the device+host systems; the others get no tier options (they would refuse them),
    and no-cache none of the cached blocks' either."""
    import kvpool.engine.llm

    built: list[dict] = []

    class Stop(Exception):
        pass

    def fake_llm(**kw: object) -> None:
        built.append(kw)
        raise Stop

    monkeypatch.setattr(kvpool.engine.llm, "LLM", fake_llm)
    a = build_parser().parse_args(["bench", "multiturn", "--host-blocks", "32"])
    for name in ("no-cache", "device", "device+host"):
        with pytest.raises(Stop):
            multiturn.run_system(name, a, {"kv_store": "file:///tmp/s", "hash_seed": "s", "host_eviction": "arc"})
    given = [sorted(k for k in kw if k in ("kv_store", "hash_seed", "host_eviction")) for kw in built]
    assert given == [[], ["hash_seed"], ["hash_seed", "host_eviction", "kv_store"]]



@pytest.mark.parametrize("flag", ["--requests", "--workload"])
def test_manager_refuses_the_generator_flags_with_a_trace(flag: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "prompt": [1, 2, 3, 4, 5], "decode": [6]}\n')
    value = "5" if flag == "--requests" else "shared-prefix"
    assert main(["bench", "manager", "--trace", str(trace), flag, value, "--repeats", "1", "--no-belady"]) == 2
    assert f"kvpool: error: {flag[2:]}: only read when generating a trace" in capsys.readouterr().err


def _no_engine(*_: Any, **__: Any) -> None:
    raise AssertionError("an engine was built")


@pytest.mark.parametrize(("flags", "message"), [
    # (with it, kvpool vs kvpool-full-attention compared the uniform allocator with itself, labelled hybrid)
    (["--no-hybrid-allocator"], "--no-hybrid-allocator: not a bench prefix flag; run --systems "
                                "kvpool,kvpool-full-attention"),
    # (kvpool-lora set both from --lora and --lora-rank, over what was given)
    (["--max-loras", "3"], "--max-loras: not a bench prefix flag; the kvpool-lora system sets it from --lora"),
    (["--max-lora-rank", "8"], "--max-lora-rank: not a bench prefix flag; the kvpool-lora system sets it from "
                               "--lora-rank"),
])
def test_prefix_refuses_the_engine_flags_its_systems_set(flags: list[str], message: str,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(prefix, "KVPoolSession", _no_engine)
    monkeypatch.setattr(prefix, "run_transformers", _no_engine)
    assert main(["bench", "prefix", "--systems", "kvpool,kvpool-full-attention,kvpool-lora", *flags]) == 2
    assert f"kvpool: error: {message}" in capsys.readouterr().err


def test_prefix_takes_the_lora_flags_at_their_defaults() -> None:
    prefix.check_engine_flags({"max_loras": 1, "max_lora_rank": 16, "hybrid_allocator": True,
                               "enable_prefix_caching": True})


@pytest.mark.parametrize(("flags", "message"), [
    (["--kv-cache-memory", "64MiB"], "--kv-cache-memory: not a bench multiturn flag; the systems' device pools "
                                     "take --device-blocks"),
    # (the two valid systems ran, minutes each, before the bad policy was found)
    (["--systems", "device,unlimited,device@nosuchpolicy"], "systems: 'device@nosuchpolicy': unknown eviction "
                                                            "policy 'nosuchpolicy'"),
    (["--systems", "device,device@nosuchpolicy:bfloat16"], "systems: 'device@nosuchpolicy:bfloat16': unknown "
                                                           "eviction policy 'nosuchpolicy'"),
])
def test_multiturn_refuses_before_the_first_system_runs(flags: list[str], message: str,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []
    monkeypatch.setattr(multiturn, "run_system", lambda n, *_: ran.append(n) or ({}, []))
    with contextlib.suppress(KeyError):  # (the fake systems report nothing: a run that goes on fails at the table)
        assert main(["bench", "multiturn", *flags]) == 2
    assert ran == []
    assert f"kvpool: error: {message}" in capsys.readouterr().err


class Ran(Exception):
    pass


def test_a_multiturn_policy_system_passes_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def first(name: str, *_: Any) -> None:
        raise Ran(name)

    monkeypatch.setattr(multiturn, "run_system", first)
    with pytest.raises(Ran, match=r"^device@lru$"):
        main(["bench", "multiturn", "--systems", "device@lru,device@reuse:bfloat16"])


@pytest.mark.parametrize("command", [
    ["bench", "policy", "--trace", "shared-prefix", "--num-blocks", "64", "--policies", "lru", "--no-belady"],
    ["bench", "multiturn"],
    ["bench", "cluster"],
])
def test_a_plot_path_that_is_a_directory_is_refused_before_the_run(command: list[str], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """It failed only once the picture was drawn, after the whole run, and the table and JSON were lost."""
    from kvpool.bench import cluster, policy

    folder = tmp_path / "out.png"
    folder.mkdir()
    monkeypatch.setattr(policy, "replay", _no_engine)
    monkeypatch.setattr(multiturn, "run_system", _no_engine)
    monkeypatch.setattr(cluster, "Replica", _no_engine)
    assert main([*command, "--plot", str(folder)]) == 2
    assert f"kvpool: error: plot: {str(folder)!r} exists and is not a file" in capsys.readouterr().err


def test_plot_path_takes_a_new_or_existing_file(tmp_path: Path) -> None:
    assert plot_path(str(tmp_path / "a.png")) == str(tmp_path / "a.png")
    (tmp_path / "b.png").write_bytes(b"")
    assert plot_path(str(tmp_path / "b.png")) == str(tmp_path / "b.png")
    assert plot_path(None) is None


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
