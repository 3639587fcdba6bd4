"""SmolLM2 in bf16 (the CPU default) with kvpool's compiled attention kernels on and off: the kernels
really run, and the greedy texts agree except where the true (fp32) next-token logits are a near-tie.

Exactness is proven elsewhere: fp32 greedy tokens equal transformers' with the decode kernel on
(test_reference, test_consistency), and each kernel matches a float64 reference (tests/runner). In bf16
two correct attention kernels round differently (bf16 logits near 25 are spaced 0.125 apart), so a
near-tie may go either way; a wrong mask or a misread block would diverge where the choice is clear.
The kernels are the CPU's, so every engine here runs on the CPU, also where a GPU is present.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner import kernels

SYSTEM = ("You are a careful assistant. Answer in one short paragraph, plainly, without lists. "
          "If you do not know, say so. ") * 6  # ~130 tokens shared by every prompt: prefix hits
QUESTIONS = ["What is a KV cache?", "Why is the sky blue?", "Name three prime numbers.", "What does a compiler do?",
             "How do bees make honey?", "Explain gravity to a child.", "What is the capital of Peru?",
             "Write a haiku about rain."]
NEAR_TIE = 0.25  # fp32 logit gap between the two tokens the runs chose


def test_bf16_kernels_on_and_off_differ_only_at_near_ties(smol_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    texts = {}
    for native in (True, False):
        llm = LLM(str(smol_dir), device="cpu", dtype="bfloat16", kv_cache_memory="64MiB", native_kernels=native,
                  max_num_batched_tokens=256)  # chunked: later chunks attend to cached context
        runner = llm.engine.runner
        assert runner.decode_kernel is native
        assert runner.prefill_kernel is (native and kernels.prefill_supported(64, 16))
        assert runner.packed_kv is runner.prefill_kernel  # the caches in the kernels' own layout
        prompts = [llm.engine.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": q}]) for q in QUESTIONS]
        outs = llm.generate(prompts, SamplingParams.greedy(24), use_tqdm=False)
        assert sum(o.num_cached_tokens for o in outs) > 0
        # bf16 with both kernels: the decode rows of prompts sharing the system prompt decode as groups.
        assert (runner.num_grouped_decode_steps > 0) is runner.prefill_kernel
        llm.engine.kv.check_integrity()
        texts[native] = [o.token_ids for o in outs]
    model = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32)
    identical = 0
    for prompt, on, off in zip(prompts, texts[True], texts[False], strict=True):
        i = next((i for i, (a, b) in enumerate(zip(on, off, strict=False)) if a != b), None)
        if i is None:
            identical += 1
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + on[:i]])).logits[0, -1]
        gap = abs(float(logits[on[i]] - logits[off[i]]))
        assert gap < NEAR_TIE, f"token {i}: {on[i]} vs {off[i]}, fp32 logits {gap:.3f} apart: not a near-tie"
        assert float(logits.max() - logits[on[i]]) < NEAR_TIE  # and the kernels' pick is itself a top choice
    assert identical >= len(QUESTIONS) // 4


@pytest.mark.parametrize(("dtype", "linear"), [("bfloat16", "auto"), ("bfloat16", "kvpool"), ("float32", "auto")])
def test_tokens_identical_with_caching_and_chunking(smol_dir: Path, dtype: str, linear: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With the prefill kernel, a row's attention arithmetic does not depend on prefix hits, grouping or
    chunking, and the linear layers (oneDNN's where it is row-count invariant, else kvpool's bf16 kernel; or
    kvpool's everywhere: KVPOOL_BF16_LINEAR=kvpool) do not depend on the row count: so prefix caching and
    chunk size change no token even in bf16 (fp32 tokens equal transformers' besides:
    tests/engine/test_reference.py)."""
    if not kernels.prefill_supported(64, 16, getattr(torch, dtype)):
        pytest.skip(f"this CPU runs no {dtype} prefill kernel: its attention runs on torch ops, which split by length")
    if linear == "kvpool" and not kernels.linear_bf16_supported():
        pytest.skip("the kernels are not built with AVX-512 BF16 here")
    monkeypatch.setenv("KVPOOL_BF16_LINEAR", linear)
    results = []
    for caching, budget in ((True, 2048), (False, 2048), (True, 96)):
        llm = LLM(str(smol_dir), device="cpu", dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=caching,
                  max_num_batched_tokens=budget)
        assert llm.engine.runner.prefill_kernel
        if linear == "kvpool":
            assert llm.engine.runner.model.layers[0].qkv_proj.own
        prompts = [llm.engine.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": q}]) for q in QUESTIONS]
        outs = llm.generate(prompts, SamplingParams.greedy(24), use_tqdm=False)
        assert (sum(o.num_cached_tokens for o in outs) > 0) is caching
        results.append([o.token_ids for o in outs])
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_packed_blocks_round_trip_through_the_host_tier(smol_dir: Path, dtype: str) -> None:
    """Blocks in the kernels' packed layout go to the host tier and come back as whole blocks: hits served
    from the host give the tokens of no caching at all (same schedule: one request at a time)."""
    if not kernels.prefill_supported(64, 16, getattr(torch, dtype)):
        pytest.skip(f"this CPU runs no {dtype} prefill kernel: no packed layout here")
    sp = SamplingParams.greedy(8)
    ref = LLM(str(smol_dir), device="cpu", dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=False)
    systems = [SYSTEM, SYSTEM.upper()]
    # Two system prompts, interleaved: with 24 device blocks, each one's blocks are sheltered on the host
    # while the other runs, and its next question hits them there.
    prompts = [ref.engine.apply_chat_template([{"role": "system", "content": systems[i % 2]},
                                               {"role": "user", "content": q}]) for i, q in enumerate(QUESTIONS[:4])]
    want = [ref.generate([p], sp, use_tqdm=False)[0].token_ids for p in prompts]
    llm = LLM(str(smol_dir), device="cpu", dtype=dtype, num_blocks=24, swap_space="16MiB")
    assert llm.engine.runner.kv_layout == {"bfloat16": "packed16", "float32": "packed8"}[dtype]
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in outs] == want
    assert all(o.num_cached_tokens > 0 for o in outs[2:])
    assert llm.engine.stats().num_blocks_swapped_in > 0
    llm.engine.kv.check_integrity()
