"""The runner's per-token outputs are the model's: transformers' hidden states for the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("invariant", [False, True])
def test_outputs_match_transformers(tiny_llama_dir: Path, invariant: bool) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=64,
              stage_outputs=True, stage_output_layers=(0,), batch_invariant=invariant, max_num_batched_tokens=7)
    prompts = [list(range(3, 25)), [*range(3, 20), 99, 98]]
    outs = llm.generate(prompts, SamplingParams.greedy(5), use_tqdm=False)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    for p, o in zip(prompts, outs, strict=True):
        so = o.stage_outputs
        assert so is not None and set(so) == {"hidden_states", "layer_0"}
        fed = p + o.token_ids[:-1]  # every token that went through the model
        assert so["hidden_states"].shape == (len(fed), 64) and so["layer_0"].shape == (len(fed), 64)
        with torch.inference_mode():
            hf = ref(torch.tensor([fed]), output_hidden_states=True).hidden_states
        # transformers' hidden_states: [embeddings, after layer 0, ..., final normed states].
        torch.testing.assert_close(so["layer_0"], hf[1][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(so["hidden_states"], hf[-1][0], atol=1e-4, rtol=1e-4)
    assert outs[1].num_cached_tokens == 16  # the shared 16 tokens' rows came from the stage-output cache
    assert llm.engine.stage_outputs is not None and llm.engine.stage_outputs.rows_from_cache == 16


def test_plain_engine_returns_no_outputs(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=64)
    out = llm.generate([list(range(3, 12))], SamplingParams.greedy(2), use_tqdm=False)[0]
    assert out.stage_outputs is None and llm.engine.runner.stage_cache is None


def test_the_stage_output_rows_are_counted_in_the_memory_budgets(tiny_llama_dir: Path) -> None:
    """Each cached token's rows (final hidden state and layer 0's: 2 x 64 fp32 values) live in host memory
    beside its block: on a CPU device the KV budget holds both, and so does the host tier's."""
    kv = 2 * 4 * 2 * 16 * 4 * 2  # K and V, block of 4, 2 kv heads x head_dim 16, fp32, 2 layers: 2 KiB
    rows = 4 * 64 * 4 * 2  # 4 tokens x hidden 64 x fp32 x (final + layer 0): 2 KiB
    llm = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory=40 * 1024,
              swap_space=80 * 1024, stage_outputs=True, stage_output_layers=(0,))
    runner = llm.engine.runner
    assert (runner.bytes_per_block, runner.stage_bytes_per_block) == (kv, rows)
    # (on a GPU the KV budget is the device's, and the rows stay in host memory)
    assert runner.num_blocks == (10 if runner.device.type == "cpu" else 20) == 40 * 1024 // (
        kv + rows if runner.device.type == "cpu" else kv)
    assert llm.engine.kv.host is not None and llm.engine.kv.host.pools[0].num_blocks == 80 * 1024 // (kv + rows) == 20
    llm.generate([list(range(3, 23))], SamplingParams.greedy(2), use_tqdm=False)
    cache = runner.stage_cache
    # exactly what was counted (on a GPU: host memory beside the device blocks, which no budget counts)
    assert cache is not None and cache.nbytes == (runner.num_blocks + 20) * rows
    plain = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=4,
                kv_cache_memory=40 * 1024)
    assert plain.engine.runner.num_blocks == 20 and plain.engine.runner.stage_bytes_per_block == 0
