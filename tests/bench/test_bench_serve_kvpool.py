"""`kvpool bench serve` against the real `kvpool serve` (a tiny random-weight Llama on 127.0.0.1):
the two sides of the OpenAI contract agree on token counts, ignore_eos, cached tokens and /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.engine.engine import LLMEngine
from kvpool.server.serve import ServerHandle, start_server

BLOCK = 16


@pytest.fixture(scope="module")
def kvpool_server(chat_llama_dir: Path) -> Iterator[ServerHandle]:
    engine = LLMEngine(model=str(chat_llama_dir), dtype="float32", num_blocks=256, block_size=BLOCK,
                       max_model_len=256, max_num_batched_tokens=256)
    h = start_server(engine, served_model_name="tiny")
    yield h
    h.stop()


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_random_dataset_against_kvpool_serve(kvpool_server: ServerHandle, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    # One at a time: every prompt after the first finds the 2-block shared prefix cached, nothing more.
    rc = main(["bench", "serve", "--base-url", kvpool_server.url, "--num-prompts", "6", "--random-prefix-len",
               str(2 * BLOCK), "--random-input-len", "20", "--random-output-len", "5", "--max-concurrency", "1",
               "--seed", "7", "--json"])
    res = last_json(capsys.readouterr().out)
    assert rc == 0 and res["model"] == "tiny"
    assert (res["completed"], res["failed"], res["total_output_tokens"], res["total_input_tokens"]) == (6, 0, 30, 312)
    assert res["output_len_mismatches"] == 0  # ignore_eos reached the engine
    assert res["cached_tokens"] == 5 * 2 * BLOCK
    assert (res["prefix_cache_queries"], res["prefix_cache_hits"]) == (312, 5 * 2 * BLOCK)
    assert res["prefix_hit_rate"] == pytest.approx(160 / 312, abs=1e-12)
    assert res["ttft_mean_ms"] > 0 and res["tpot_mean_ms"] > 0 and res["itl_median_ms"] > 0


def test_a_refused_request_is_counted_failed_with_the_servers_message(
        kvpool_server: ServerHandle, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"id": "ok", "prompt": [1000] * 40, "decode": [1, 2, 3]}) + "\n"
                     + json.dumps({"id": "long", "prompt": [1001] * 300, "decode": [1, 2, 3]}) + "\n")
    rc = main(["bench", "serve", "--base-url", kvpool_server.url, "--dataset-name", "trace", "--dataset-path",
               str(trace), "--json"])
    cap = capsys.readouterr()
    res = last_json(cap.out)
    assert rc == 0 and (res["completed"], res["failed"], res["total_output_tokens"]) == (1, 1, 3)
    [err] = res["errors"]
    assert err["count"] == 1 and err["message"].startswith("HTTP 400: ") and "256" in err["message"]
    assert err["message"] in cap.err
