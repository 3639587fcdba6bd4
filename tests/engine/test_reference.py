"""Greedy tokens identical to transformers' generate on the same weights (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import TINY_VOCAB, hf_greedy

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams


def tiny_prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(n)]


def test_tiny_llama_matches_transformers(tiny_llama_dir: Path) -> None:
    prompts = tiny_prompts()
    expected = hf_greedy(tiny_llama_dir, prompts, 24)
    llm = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=128)
    outs = llm.generate(prompts, SamplingParams.greedy(24), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected


@pytest.fixture(scope="module")
def smol_llm(smol_dir: Path) -> LLM:
    return LLM(str(smol_dir), dtype="float32", kv_cache_memory="256MiB")


def test_smollm2_matches_transformers(smol_llm: LLM, smol_dir: Path) -> None:
    tok = smol_llm.tokenizer
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):",
                                       "Once upon a time in a small village,")]
    prompts.append(smol_llm.engine.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]))
    expected = hf_greedy(smol_dir, prompts, 20)
    outs = smol_llm.generate(prompts, SamplingParams.greedy(20), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert outs[3].text == tok.decode(expected[3], skip_special_tokens=True)


def test_smollm2_chat_and_text(smol_llm: LLM) -> None:
    out = smol_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams.greedy(20), use_tqdm=False)[0]
    assert "Paris" in out.text
    assert out.outputs[0].finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>
    assert out.metrics is not None and out.metrics.first_token_time is not None
    assert out.metrics.arrival_time <= out.metrics.first_token_time <= out.metrics.finished_time


def test_stop_strings_cut_the_text(smol_llm: LLM) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = smol_llm.chat(msgs, SamplingParams.greedy(20), use_tqdm=False)[0]
    assert "Paris" in full.text
    out = smol_llm.chat(msgs, SamplingParams.greedy(20, stop=["Paris"]), use_tqdm=False)[0]
    assert out.text == full.text[: full.text.index("Paris")]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "Paris"
    assert len(out.token_ids) < len(full.token_ids)
    kept = smol_llm.chat(msgs, SamplingParams.greedy(20, stop=["Paris"], include_stop_str_in_output=True),
                         use_tqdm=False)[0]
    assert kept.text.endswith("Paris")
    assert smol_llm.engine.kv.usage == 0  # the stopped requests' blocks were freed
