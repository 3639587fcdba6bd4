"""`kvpool bench memory`: the RFC's uniform waste figures, kvpool's waste, and the JSON contract."""

from __future__ import annotations

import json

import pytest

from kvpool.cli import main


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict]:
    assert main(["bench", "memory", "--json", *args]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("model") and "uniform waste" in out[0]
    return json.loads(out[-1])["cases"]


def test_gemma2_reproduces_the_rfc_25_percent(capsys: pytest.CaptureFixture[str]) -> None:
    (case,) = bench(capsys, "--models", "gemma-2-9b", "--contexts", "8192", "--budget", "16GiB")
    # 21 full layers hold 8192 tokens, 21 sliding layers 4096: a uniform allocator holds 8192 in all 42.
    assert case["uniform_waste"] == 0.25 and case["rfc_uniform_waste"] == 0.25
    # kvpool's only excess: each request's sliding group holds one block more than its window, the one
    # before the prompt's last boundary (where a repeat of the prompt, last token recomputed, would hit).
    assert 0 < case["kvpool_waste"] < 0.002 and case["groups"] == 2 and not case["two_level"]
    # Per request: 42 * 8192 * 8 KiB (uniform) vs 21 * (8192 + 4096) * 8 KiB (kvpool); 16 GiB budget.
    assert case["uniform_bytes_per_request"] == 42 * 8192 * 8192
    assert case["needed_bytes_per_request"] == 21 * 12288 * 8192
    assert case["kvpool_bytes_per_request"] == 21 * (12288 + 16) * 8192  # + the one held block (see above)
    # 6240 usable blocks of 21 layers: a request holds 768 once prefilled, but its last 2048-token chunk
    # needs the window's 256 blocks plus 128 more for the sliding group: 7 * 768 + 512 + 384 > 6240.
    assert (case["uniform_max_requests"], case["kvpool_max_requests"]) == (6, 7)


def test_mllama_reproduces_the_rfc_79_6_percent_with_its_block_size_1(capsys: pytest.CaptureFixture[str]) -> None:
    cases = bench(capsys, "--models", "llama-3.2-11b-vision", "--contexts", "43", "--block-size", "1",
                  "--budget", "2GiB")
    four_tiles = next(c for c in cases if c["image"] == [1120, 1120])
    assert four_tiles["encoder_tokens"] == 4 * 1601
    assert round(four_tiles["uniform_waste"], 4) == four_tiles["rfc_uniform_waste"] == 0.796
    assert four_tiles["kvpool_waste"] == 0.0
    assert four_tiles["kvpool_max_requests"] > 4 * four_tiles["uniform_max_requests"]


def test_jamba_uses_two_level_pages_within_the_waste_target(capsys: pytest.CaptureFixture[str]) -> None:
    (case,) = bench(capsys, "--models", "jamba-mini", "--contexts", "4096", "--budget", "4GiB")
    assert case["two_level"] and case["groups"] == 8
    assert 0.0 <= case["kvpool_waste"] <= 0.02
    assert case["kvpool_max_requests"] > 5 * case["uniform_max_requests"] > 0


def test_bad_arguments_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "memory", "--models", "nope"]) == 2
    assert "models: no config" in capsys.readouterr().err
    assert main(["bench", "memory", "--models", "gemma-2-9b", "--budget", "1MiB"]) == 2
    assert "budget: 1048576 bytes hold fewer than 2 pages" in capsys.readouterr().err
    assert main(["bench", "memory", "--models", "gemma-2-9b", "--contexts", "0"]) == 2
    assert "contexts: every length must be >= 1" in capsys.readouterr().err
