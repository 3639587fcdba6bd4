"""The same greedy tokens whatever the cache does: prefix caching on or off, any chunk size, a pool
small enough to preempt, batched or one at a time. Tiny random-weight Llama, fp32."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import TINY_VOCAB, hf_greedy

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams

N_NEW = 20


def shared_prefix_prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    # 72 shared tokens: long enough for the runner's cascade attention over shared prefixes.
    systems = [[rng.randrange(TINY_VOCAB) for _ in range(72)] for _ in range(2)]
    return [systems[i % 2] + [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 30))] for i in range(10)]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, shared_prefix_prompts(), N_NEW)


def run(model: Path, prompts: list[list[int]], **kw: object) -> tuple[list[list[int]], LLM]:
    kw = {"num_blocks": 256, **kw}
    llm = LLM(str(model), dtype="float32", skip_tokenizer_init=True, block_size=4, **kw)  # type: ignore[arg-type]
    outs = llm.generate(prompts, SamplingParams.greedy(N_NEW), use_tqdm=False)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.get_num_free_blocks() == llm.engine.kv.block_pool.num_usable_blocks
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [2048, 16, 5])
def test_caching_and_chunk_sizes(tiny_llama_dir: Path, expected: list[list[int]], caching: bool,
                                 budget: int) -> None:
    got, llm = run(tiny_llama_dir, shared_prefix_prompts(), enable_prefix_caching=caching,
                   max_num_batched_tokens=budget)
    assert got == expected
    if caching:
        assert llm.engine.kv.stats.hits > 0


def test_pool_small_enough_to_preempt(tiny_llama_dir: Path, expected: list[list[int]]) -> None:
    # 10 requests of up to 121 tokens in 46 blocks of 4: running ones outgrow the pool as they decode.
    got, llm = run(tiny_llama_dir, shared_prefix_prompts(), num_blocks=47)
    assert got == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0


def test_preemption_without_caching(tiny_llama_dir: Path, expected: list[list[int]]) -> None:
    got, llm = run(tiny_llama_dir, shared_prefix_prompts(), num_blocks=47, enable_prefix_caching=False,
                   max_num_batched_tokens=7)
    assert got == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0


def test_cascade_attention_on_and_off(tiny_llama_dir: Path, expected: list[list[int]]) -> None:
    got, llm = run(tiny_llama_dir, shared_prefix_prompts(), device="cpu")  # cascades are on by default there
    assert llm.engine.runner.enable_cascade and llm.engine.runner.num_cascade_steps > 0
    assert got == expected


@pytest.mark.parametrize("native", [True, False])
def test_decode_kernel_on_and_off(tiny_llama_dir: Path, expected: list[list[int]], native: bool) -> None:
    got, llm = run(tiny_llama_dir, shared_prefix_prompts(), native_kernels=native, device="cpu")  # CPU kernels
    assert llm.engine.runner.decode_kernel is native  # the kernel builds here: CI must not skip it silently
    assert got == expected


def test_batched_equals_one_at_a_time(tiny_llama_dir: Path, expected: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=256)
    singles = [llm.generate([p], SamplingParams.greedy(N_NEW), use_tqdm=False)[0].token_ids
               for p in shared_prefix_prompts()]
    assert singles == expected


def test_prefix_cache_skips_the_cached_tokens(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=256)
    rng = random.Random(5)
    shared = [rng.randrange(TINY_VOCAB) for _ in range(64)]
    first = llm.generate([[*shared, 1, 2, 3]], SamplingParams.greedy(5), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    ran = llm.engine.runner.num_tokens_computed
    # 67 prompt tokens + 4 decode steps (the 5th token is sampled, never fed back).
    assert ran == 67 + 4
    second = llm.generate([[*shared, 9, 8, 7, 6, 5]], SamplingParams.greedy(5), use_tqdm=False)[0]
    assert second.num_cached_tokens == 64
    assert llm.engine.runner.num_tokens_computed - ran == (69 - 64) + 4
    fresh = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=256,
                enable_prefix_caching=False)
    assert fresh.generate([[*shared, 9, 8, 7, 6, 5]], SamplingParams.greedy(5),
                          use_tqdm=False)[0].token_ids == second.token_ids


@pytest.mark.parametrize("host", [dict(host_eviction="lru"), dict(host_eviction="arc"),
                                  dict(host_eviction="lru", write_through=True)])
def test_host_tier_gives_identical_tokens(tiny_llama_dir: Path, expected: list[list[int]], host: dict) -> None:
    prompts = shared_prefix_prompts()
    llm = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=47,
              num_host_blocks=160, **host)
    eng = llm.engine
    first = [o.token_ids for o in llm.generate(prompts, SamplingParams.greedy(N_NEW), use_tqdm=False)]
    assert first == expected and eng.scheduler.stats.num_preemptions > 0
    # Unrelated prompts push the first round out of the device pool, into the host tier.
    rng = random.Random(9)
    llm.generate([[rng.randrange(TINY_VOCAB) for _ in range(100)] for _ in range(3)], SamplingParams.greedy(4),
                 use_tqdm=False)
    eng.kv.take_prefix_cache_stats()
    # The device pool no longer holds the first round: every hit has to come from the host tier.
    again = llm.generate(prompts[:1], SamplingParams.greedy(N_NEW), use_tqdm=False)[0]
    stats = eng.kv.take_prefix_cache_stats()
    assert again.token_ids == expected[0]
    assert stats.hits >= 72 and stats.host_hits == stats.hits and again.num_cached_tokens == stats.hits
    assert again.metrics is not None and again.metrics.num_host_cached_tokens == stats.hits
    assert eng.runner.num_blocks_swapped_in == eng.kv.swap_stats.blocks_in > 0
    # And everything again, device and host hits mixed, with preemption.
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams.greedy(N_NEW), use_tqdm=False)] == expected
    eng.kv.check_integrity()
