"""`kvpool omni` on the default model, and `kvpool bench omni`'s JSON on tiny models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_tiny_llama

from kvpool.cli import main


def test_omni_default_model(smol_dir: Path, tmp_path: Path) -> None:
    img = tmp_path / "img.npy"
    np.save(img, torch.rand((3, 8, 8), generator=torch.Generator().manual_seed(0)).numpy())
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "omni", "What is the capital of France?",
                          "--thinker-tokens", "10", "--talker-tokens", "4", "--kv-cache-memory", "64MiB",
                          "--image", str(img)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("thinker: ") and "Paris" in lines[0]
    codes = lines[1].removeprefix("talker:").split()
    assert len(codes) == 4 and all(0 <= int(c) < 64 for c in codes)
    assert "input embeddings, 0 cached thinker tokens" in lines[2]


def test_bench_omni_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    thinker = make_tiny_llama(tmp_path / "thinker", vocab_size=40960)
    assert main(["bench", "omni", "--model", str(thinker), "--groups", "1", "--questions", "2", "--system-len", "32",
                 "--question-len", "8", "--images", "1", "--image-size", "16", "--thinker-tokens", "2",
                 "--talker-tokens", "2", "--block-size", "4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Second question of the group: 32 of 40 prompt tokens hit; of the image's, its 16 image tokens.
    assert res["hit_rate"] == pytest.approx(32 / 80)
    assert res["ideal_speedup"] == pytest.approx(1 / (1 - 32 / 80))
    assert res["stage2_identical"] is True and res["stage1_prefill_speedup"] > 0
    assert res["images"]["hit_rate"] == pytest.approx(16 / 48)
    assert res["images"]["on"]["encoder_runs"] == 1 and res["images"]["off"]["encoder_runs"] == 2
    assert res["encoder_runs_saved"] == 1
    assert res["shared_prefix"]["on"]["computed_prompt_tokens"] == 80 - 32


BENCH = ["bench", "omni", "--questions", "2", "--system-len", "32", "--question-len", "8", "--image-size", "16",
         "--thinker-tokens", "2", "--talker-tokens", "2", "--block-size", "4", "--json"]


def test_bench_omni_with_one_workload_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    thinker = make_tiny_llama(tmp_path / "thinker", vocab_size=40960)
    # Text only: the image workload is left out (it has no requests), not a crash on its empty statistics.
    assert main([*BENCH, "--model", str(thinker), "--groups", "1", "--images", "0"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "images" not in res and res["hit_rate"] == pytest.approx(32 / 80) and res["encoder_runs_saved"] == 0
    assert res["stage2_identical"] is True


@pytest.mark.parametrize(("flags", "message"), [
    (["--groups", "0", "--images", "0"], "kvpool: error: --groups, --images: both 0 leave no workload to run"),
    (["--image-size", "18"], "argument --image-size: must be a multiple of 4 (the tower's patch side), got 18"),
    (["--questions", "0"], "argument --questions: must be >= 1, got 0"),
    (["--images", "-1"], "argument --images: must be >= 0, got -1"),
])
def test_bench_omni_refuses_bad_flags_before_loading_a_model(flags: list[str], message: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # (a model folder that does not exist: the flags are refused before anything loads)
    try:
        rc = main([*BENCH, "--model", "/nonexistent/model", *flags])
    except SystemExit as e:  # argparse's refusal of a flag's value
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err
