"""The real Gemma-3 270M (optional: the `gemma` extra) on the hybrid allocator: prompts longer than its
512-token window, sharing a long prefix, greedy tokens identical to transformers, the second prompt a
prefix hit in the full-attention group and in all five sliding-window groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import hf_greedy

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner import kernels
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


def test_host_tier_restores_every_group_of_a_long_prefix(gemma_dir: Path) -> None:
    # A device pool that holds one long request; a host tier that holds everything. The second question
    # about the document comes after an unrelated prompt has pushed the document's blocks out of the
    # device: its hit comes back from the host tier in the full group and all five sliding groups.
    kw = dict(dtype="float32", block_size=16, max_num_batched_tokens=256)
    llm = LLM(str(gemma_dir), num_blocks=330, num_host_blocks=1500, **kw)
    doc = " ".join(f"Item {i} weighs {(i * 37) % 100} grams." for i in range(70))
    other = " ".join(f"City {i} has {(i * 53) % 1000} trees." for i in range(75))
    prompts = [llm.engine.encode(doc + f"\nQuestion: how much does item {q} weigh?\nAnswer:") for q in (17, 63)]
    filler = llm.engine.encode(other + "\nQuestion: which city has the most trees?\nAnswer:")
    order = [prompts[0], filler, prompts[1]]
    outs = [llm.generate([p], SamplingParams.greedy(6), use_tqdm=False)[0] for p in order]
    assert [o.token_ids for o in outs] == hf_greedy(gemma_dir, order, 6)
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    assert outs[2].num_cached_tokens == shared // 16 * 16
    kv = llm.engine.kv
    assert kv.stats.host_hits > outs[2].num_cached_tokens // 2  # most of the hit came from the host tier
    kv.check_integrity()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tokens_do_not_depend_on_allocator_caching_chunking_or_preemption(gemma_dir: Path, dtype: str) -> None:
    # On the kernels every attention row of Gemma-3 (head_dim 256) goes through the prefill kernel, prompt
    # chunks and decode rows alike, whose arithmetic per row does not depend on the batch. So the hybrid and
    # the uniform allocator, prefix caching on and off, another chunk size and a pool small enough to
    # preempt (decoded tokens recomputed in a prompt chunk) all give the same tokens. (The uniform allocator
    # runs without caching and in chunks of 64: three changes in one run, each a difference from the base,
    # to keep the suite's time; a fault in one that another exactly undid is not a plausible escape.)
    docs = [" ".join(f"Item {i} weighs {(i * 37) % 100} grams." for i in range(60)),
            " ".join(f"City {i} has {(i * 53) % 1000} trees." for i in range(55))]
    if not kernels.prefill_supported(256, 16, getattr(torch, dtype)):
        # (bf16 without AVX-512 BF16, fp32 without AVX2) attention then runs on torch ops, whose rows do
        # depend on the batch: this property is the kernel's.
        pytest.skip(f"this CPU runs no {dtype} prefill kernel")
    kw = dict(dtype=dtype, block_size=16, max_num_batched_tokens=256)
    base = LLM(str(gemma_dir), num_blocks=900, **kw)
    assert base.engine.runner.prefill_kernel, "the prefill kernel must take head_dim 256 on this machine"
    prompts = [base.engine.encode(d + f"\nQuestion: what about number {q}?\nAnswer:") for d in docs for q in (5, 17)]
    assert min(map(len, prompts)) > 512  # past the sliding window
    sp = SamplingParams.greedy(40)
    want = [o.token_ids for o in base.generate(prompts, sp, use_tqdm=False)]
    settings = {
        "uniform allocator, no prefix caching, chunks of 64": dict(hybrid_allocator=False, num_blocks=300,
                                                                   enable_prefix_caching=False,
                                                                   max_num_batched_tokens=64),
        "a pool that preempts": dict(num_blocks=250, max_num_batched_tokens=64),
    }
    for name, setting in settings.items():
        llm = LLM(str(gemma_dir), **{**kw, "num_blocks": 900, **setting})
        got = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want, name
        if name == "a pool that preempts":
            assert llm.engine.scheduler.stats.num_preemptions > 0
        llm.engine.kv.check_integrity()
