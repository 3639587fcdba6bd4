"""The real Gemma-3 270M (optional: the `gemma` extra) on the hybrid allocator: prompts longer than its
512-token window, sharing a long prefix, greedy tokens identical to transformers, the second prompt a
prefix hit in the full-attention group and in all five sliding-window groups."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import hf_greedy

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.model_files import GEMMA3_MODEL, ModelNotFoundError, resolve_model


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    try:
        return resolve_model(GEMMA3_MODEL)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


def test_long_shared_prefix_matches_transformers(gemma_dir: Path) -> None:
    llm = LLM(str(gemma_dir), dtype="float32", num_blocks=600, block_size=16, max_num_batched_tokens=256)
    doc = " ".join(f"Item {i} weighs {(i * 37) % 100} grams." for i in range(120))
    prompts = [llm.engine.encode(doc + f"\nQuestion: how much does item {q} weigh?\nAnswer:") for q in (17, 63)]
    assert min(len(p) for p in prompts) > 2 * 512  # well past the window
    want = hf_greedy(gemma_dir, prompts, 8)
    outs = [llm.generate([p], SamplingParams.greedy(8), use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in outs] == want
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    assert outs[1].num_cached_tokens == shared // 16 * 16 > 1000
    llm.engine.kv.check_integrity()
