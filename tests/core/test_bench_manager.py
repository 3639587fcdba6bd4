"""`kvpool bench manager`: the replay, its JSON contract, and the Belady reference."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.bench.belady import belady_hit_rate
from kvpool.bench.replay import PoolTooSmall, replay
from kvpool.bench.workloads import load_trace, multi_turn_trace, shared_prefix_trace, write_trace
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager


def test_json_contract_and_table(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, shared_prefix_trace(60, seed=3))
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "manager", "--trace", str(trace),
                          "--num-blocks", "1200", "--concurrency", "8", "--repeats", "2", "--json"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    res = json.loads(lines[-1])
    for key in ("hit_rate", "requests_per_s", "blocks_per_s", "wall_s", "belady_hit_rate"):
        assert key in res
    assert set(res["us_per_request_or_decode_token"]) == {
        "hash_prompt", "lookup", "allocate_prefill", "decode_append", "decode_allocate", "free"}
    assert res["requests"] == 60 and 0 < res["hit_rate"] <= res["belady_hit_rate"] < 1
    assert any(line.startswith("hit rate (LRU)") for line in lines)


def test_hit_rate_is_the_exact_count_of_reused_tokens() -> None:
    # Two requests, sequential: the second shares 2 full blocks of 4 with the first.
    trace = [dict(id="a", prompt=list(range(10)), decode=[1, 2]),
             dict(id="b", prompt=[*range(8), 50, 51, 52], decode=[3])]
    r = replay(trace, KVCacheManager(16, 4), BlockHasher(4), concurrency=1)  # type: ignore[arg-type]
    assert (r.hit_tokens, r.prompt_tokens) == (8, 21)


def test_belady_beats_or_matches_lru_on_multi_turn() -> None:
    trace = multi_turn_trace(16, 4, seed=1)
    lru = replay(trace, KVCacheManager(256, 16), BlockHasher(16), 4).hit_rate
    opt = belady_hit_rate(trace, 256, 16, 4)
    assert opt > lru > 0.2  # the pool holds a part of the working set: the policy matters


def test_a_trace_of_which_nothing_fits_is_reported() -> None:
    trace = [dict(id="a", prompt=list(range(100)), decode=[])]
    with pytest.raises(PoolTooSmall, match="no request of the trace fits a pool of 7 blocks"):
        replay(trace, KVCacheManager(8, 4), BlockHasher(4), 1)  # type: ignore[arg-type]


def test_trace_file_errors_name_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "a", "prompt": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: trace line lacks 'decode'"):
        load_trace(p)


def test_a_prompt_that_does_not_fit_waits_for_the_requests_in_flight() -> None:
    # 8 usable blocks of 4 tokens. a holds 5 (then 6 as it decodes); b needs 5: it waits for a to finish.
    trace = [dict(id="a", prompt=list(range(20)), decode=[1, 2, 3, 4]),
             dict(id="b", prompt=list(range(100, 120)), decode=[5])]
    mgr = KVCacheManager(9, 4)
    r = replay(trace, mgr, BlockHasher(4), concurrency=2)  # type: ignore[arg-type]
    assert (r.waited, r.preempted, r.skipped) == (1, 0, 0)
    assert (r.hit_tokens, r.prompt_tokens) == (0, 40)
    assert mgr.get_num_free_blocks() == 8


def test_a_decode_step_that_does_not_fit_preempts_the_newest_request() -> None:
    # a and b hold 3 blocks each; each needs 5 by its end, 10 > 8: b is preempted for a, resumes from
    # its prompt plus what it had generated, and its resumed lookup is not counted again.
    trace = [dict(id="a", prompt=list(range(12)), decode=list(range(8))),
             dict(id="b", prompt=list(range(100, 112)), decode=list(range(8)))]
    mgr = KVCacheManager(9, 4)
    r = replay(trace, mgr, BlockHasher(4), concurrency=2)  # type: ignore[arg-type]
    assert (r.preempted, r.skipped) == (1, 0)
    assert (r.hit_tokens, r.prompt_tokens) == (0, 24)
    assert mgr.get_num_free_blocks() == 8


def test_a_request_larger_than_the_pool_is_skipped_and_the_rest_replayed() -> None:
    trace = [dict(id="big", prompt=list(range(40)), decode=[1]),
             dict(id="a", prompt=list(range(100, 110)), decode=[1]),
             dict(id="b", prompt=list(range(100, 110)), decode=[2])]
    r = replay(trace, KVCacheManager(9, 4), BlockHasher(4), concurrency=1)  # type: ignore[arg-type]
    assert (r.waited, r.preempted, r.skipped) == (0, 0, 1)
    assert (r.hit_tokens, r.prompt_tokens) == (8, 20)  # b hits a's two full blocks; big is not counted


def test_requests_per_second_counts_the_requests_replayed_not_the_skipped(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [dict(id="big", prompt=list(range(40)), decode=[1]),
                        *(dict(id=f"r{i}", prompt=list(range(100, 110)), decode=[i]) for i in range(3))])
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "manager", "--trace", str(trace),
                          "--num-blocks", "9", "--block-size", "4", "--concurrency", "1", "--repeats", "1",
                          "--no-belady", "--json"], capture_output=True, text=True, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert (res["requests"], res["skipped"]) == (4, 1)
    assert res["requests_per_s"] * res["wall_s"] == pytest.approx(3)


def test_the_table_and_the_json_count_the_replayed_requests_and_their_blocks(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """One computation for both: the table's requests/s counted the skipped request, and blocks/s (both)
    counted its blocks. big: 11 blocks of 4, skipped; r0..r2: 3 blocks each, replayed."""
    from kvpool.cli import main

    trace = tmp_path / "t.jsonl"
    write_trace(trace, [dict(id="big", prompt=list(range(40)), decode=[1]),
                        *(dict(id=f"r{i}", prompt=list(range(100, 110)), decode=[i]) for i in range(3))])
    assert main(["bench", "manager", "--trace", str(trace), "--num-blocks", "9", "--block-size", "4",
                 "--concurrency", "1", "--repeats", "1", "--no-belady", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    assert res["skipped"] == 1
    assert res["requests_per_s"] * res["wall_s"] == pytest.approx(3)
    assert res["blocks_per_s"] * res["wall_s"] == pytest.approx(9)
    table = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[2:-1])
    assert table["requests/s"] == f"{res['requests_per_s']:,.0f}"
    assert table["blocks/s"] == f"{res['blocks_per_s']:,.0f}"


def test_the_replay_names_the_skipped_requests() -> None:
    trace = [dict(id="a", prompt=list(range(10)), decode=[1]),
             dict(id="big", prompt=list(range(40)), decode=[1]),  # does not fit the empty pool
             dict(id="long", prompt=list(range(10)), decode=list(range(30)))]  # its answer never fits
    r = replay(trace, KVCacheManager(9, 4), BlockHasher(4), concurrency=1)  # type: ignore[arg-type]
    assert sorted(r.skipped_indices) == [1, 2] and r.skipped == 2


def test_a_request_skipped_mid_answer_takes_its_prompt_out_of_the_hit_rate() -> None:
    """Its prompt fits (and was looked up), its answer never does: skipped, it is not in the hit rate."""
    trace = [dict(id="a", prompt=list(range(10)), decode=[1]),
             dict(id="long", prompt=list(range(10)), decode=list(range(30))),  # 40 tokens: 10 blocks > 8
             dict(id="b", prompt=list(range(10)), decode=[2])]
    r = replay(trace, KVCacheManager(9, 4), BlockHasher(4), concurrency=1)  # type: ignore[arg-type]
    assert (r.waited, r.preempted, r.skipped) == (0, 0, 1)
    assert (r.hit_tokens, r.prompt_tokens) == (8, 20)  # b hits a's two full blocks; long is not counted


def test_host_hits_are_counted_at_first_admission_like_the_hit_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """b's prompt is found in the host tier (a's blocks, evicted there by c): the replay counts it as it
    counts hits, once per request at its first admission (`bench manager`'s host hit rate)."""
    trace = [dict(id="a", prompt=list(range(12)), decode=[1]),
             dict(id="c", prompt=list(range(100, 120)), decode=[1]),
             dict(id="b", prompt=list(range(13)), decode=[2])]
    mgr = KVCacheManager(7, 4, num_host_blocks=8)
    r = replay(trace, mgr, BlockHasher(4), concurrency=1)  # type: ignore[arg-type]
    assert (r.hit_tokens, r.host_hit_tokens, r.prompt_tokens) == (12, 12, 45)


SHARED = Path(__file__).resolve().parents[3] / "shared" / "peers"


@pytest.mark.skipif(not (SHARED / "mooncake_trace.py").exists(), reason="needs ../shared/peers")
def test_mooncakes_own_format_is_read_as_the_peers_script_converts_it(tmp_path: Path) -> None:
    src = SHARED / "traces" / "mooncake_synthetic_trace.jsonl"
    converted = tmp_path / "mc.jsonl"
    subprocess.run([sys.executable, str(SHARED / "mooncake_trace.py"), str(src), str(converted)], check=True,
                   capture_output=True)
    ours = load_trace(src)
    assert len(ours) == 3993 and ours == load_trace(converted)


@pytest.mark.parametrize(("text", "message"), [
    ('{"id": "a", "prompt": "hello", "decode": []}\n', "'prompt' must be a list of token ids"),
    ("not json\n", "bad.jsonl:1: not a JSON line"),
    ('[1, 2]\n', "a trace line must be a JSON object"),
    ('{"hash_ids": [1], "input_length": 10}\n', "lacks an integer 'output_length'"),
    ('{"hash_ids": [1], "input_length": 10, "output_length": 2}\n{"id": "a", "prompt": [1], "decode": []}\n',
     "mixes Mooncake lines"),
])
def test_a_bad_trace_line_is_named(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_trace(p)


def test_a_newer_request_that_cannot_grow_beside_an_older_one_waits_preempted_not_skipped() -> None:
    # 8 usable blocks. a (older) holds 4 and grows to 7; b (newer) holds 3 and needs a 4th in the first
    # round, when a has just taken the last free block: b is preempted to wait for room, never dropped.
    trace = [dict(id="a", prompt=list(range(16)), decode=list(range(10))),
             dict(id="b", prompt=list(range(100, 112)), decode=list(range(10)))]
    mgr = KVCacheManager(9, 4)
    r = replay(trace, mgr, BlockHasher(4), concurrency=2)  # type: ignore[arg-type]
    assert r.skipped == 0 and r.preempted >= 1
    assert r.prompt_tokens == 28  # each prompt counted once, however often b resumed
    assert mgr.get_num_free_blocks() == 8
