"""`kvpool bench serve --dataset-name images` against the real `kvpool serve` on the tiny chat Mllama: random
PNGs sent as data URLs in chat content parts, repeated pictures served from the encoder and prefix caches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.engine.engine import LLMEngine
from kvpool.server.serve import start_server

BLOCK = 4


def test_images_dataset_against_kvpool_serve(chat_mllama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine = LLMEngine(model=str(chat_mllama_dir), dtype="float32", num_blocks=256, block_size=BLOCK,
                       max_model_len=256, max_num_batched_tokens=256)
    h = start_server(engine, served_model_name="vis")
    try:
        # One at a time, 8 requests over 3 pictures: each picture's first request runs the vision tower, and
        # every later one finds its encoder states and its prompt's full blocks cached.
        rc = main(["bench", "serve", "--base-url", h.url, "--dataset-name", "images", "--num-prompts", "8",
                   "--images-num-unique", "3", "--images-width", "24", "--images-height", "16",
                   "--images-output-len", "3", "--max-concurrency", "1", "--seed", "3", "--json"])
        res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    finally:
        h.stop()
    assert rc == 0 and res["endpoint"] == "/v1/chat/completions" and res["dataset_name"] == "images"
    assert (res["completed"], res["failed"], res["total_output_tokens"]) == (8, 0, 24)
    assert res["output_len_mismatches"] == 0
    distinct = engine.mm.encoder_runs
    assert 1 < distinct <= 3  # (the seed's draws use 2 or 3 of the pictures)
    n_prompt = res["total_input_tokens"] // 8  # one template, one image token: every prompt has the same length
    assert res["cached_tokens"] == (8 - distinct) * ((n_prompt - 1) // BLOCK * BLOCK)
    assert res["ttft_mean_ms"] > 0 and res["tpot_mean_ms"] > 0
