"""The README's main command: `kvpool generate` on the default model, from the shell."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_generate_default_model(smol_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "generate", "What is the capital of France?",
                          "--max-tokens", "12", "--kv-cache-memory", "64MiB"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "KV cache:" in out.stderr and "blocks of 16 tokens" in out.stderr


def test_generate_reports_bad_input_without_a_traceback(tiny_llama_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "generate", "hi", "--model", "/nonexistent/model"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "kvpool: error: model:" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "generate", "hi", "--max-tokens", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "max_tokens" in out.stderr


@pytest.mark.skipif(sys.platform != "linux" or not ctypes.util.find_library("tcmalloc_minimal"),
                    reason="no tcmalloc on this system")
def test_cli_runs_on_tcmalloc_unless_told_not_to() -> None:
    cmd = [sys.executable, "-m", "kvpool.cli", "-v", "bench", "memory", "--models", "gemma-2-9b", "--contexts", "2048"]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KVPOOL_MALLOC")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "allocator: tcmalloc" in out.stderr
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**env, "KVPOOL_MALLOC": "system"})
    assert out.returncode == 0, out.stderr
    assert "allocator: the system's malloc" in out.stderr


def test_generate_takes_the_models_sampling_defaults_unless_told_otherwise(chat_llama_dir: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A model whose generation_config.json samples (temperature 1.5, top_k 50): `kvpool generate` samples as
    it says (two seeds, two answers); with --generation-config vllm, or a --temperature 0, it is greedy."""
    import argparse
    import json
    import shutil

    from kvpool.cli import cmd_generate

    d = tmp_path / "sampling-model"
    shutil.copytree(chat_llama_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 1.5, "top_k": 50}))

    def run(seed: int, temperature: float | None = None, mode: str = "auto") -> str:
        a = argparse.Namespace(prompt=["hello there"], raw=True, max_tokens=8, temperature=temperature, top_p=None,
                               top_k=None, seed=seed, stop=None)
        cmd_generate(a, dict(model=str(d), dtype="float32", num_blocks=64, generation_config=mode))
        return capsys.readouterr().out

    assert run(1) != run(2)
    assert run(1, mode="vllm") == run(2, mode="vllm") == run(3, temperature=0.0)
