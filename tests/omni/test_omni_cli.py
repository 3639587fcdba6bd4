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
