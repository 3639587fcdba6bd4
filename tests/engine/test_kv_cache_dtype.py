"""`kv_cache_dtype`: keys and values stored in bf16 or fp16 under an fp32 model, twice the blocks in the
same memory (fp8, e4m3 or e5m2: four times). Greedy tokens equal transformers' with its cache rounding
every key and value to the same dtype (and, but for fp16's, differ from plain fp32's on these prompts, so
the comparison can fail), with prefix caching on and off, chunked prefill, hits served by the host tier,
preemption, a sliding-window model and the store tier, on the torch path and on kvpool's fp32 CPU kernels
(which read 16-bit and fp8 pages); blocks stored under another KV dtype are never read; models whose KV
pages share bytes with state layers refuse it by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import TINY_VOCAB, hf_greedy, make_tiny_hybrid_gemma3, make_tiny_hybrid_lfm2, make_tiny_llama

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner import kernels

BS = 4
N_OUT = 24
_rng = random.Random(3)
PREFIX = [_rng.randrange(TINY_VOCAB) for _ in range(37)]
# Three prompts over one shared prefix (the later ones hit it), two unrelated ones.
PROMPTS = [PREFIX + [_rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (5, 11, 2)] + \
    [[_rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (9, 50)]
KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def refs(tiny_llama_dir: Path) -> dict[str, list[list[int]]]:
    out = {name: hf_greedy(tiny_llama_dir, PROMPTS, N_OUT, kv_dtype=dt) for name, dt in KV_DTYPES.items()}
    out["float32"] = hf_greedy(tiny_llama_dir, PROMPTS, N_OUT)
    return out


def generate(llm: LLM) -> list[list[int]]:
    """One prompt at a time (later ones hit earlier ones' blocks), then all together: the second pass's
    tokens, after checking that they equal the first's."""
    alone = [llm.generate([p], SamplingParams.greedy(N_OUT), use_tqdm=False)[0].token_ids for p in PROMPTS]
    together = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams.greedy(N_OUT), use_tqdm=False)]
    assert together == alone
    llm.engine.kv.check_integrity()
    return together


@pytest.mark.parametrize("kv_dtype", sorted(KV_DTYPES))
def test_tokens_equal_transformers_rounding_its_cache(tiny_llama_dir: Path, refs: dict[str, list[list[int]]],
                                                      kv_dtype: str) -> None:
    # bf16's and fp8's rounding change some tokens of these prompts: an engine that ignored it would fail
    # below (fp16 keeps 10 mantissa bits to bf16's 7, and changes none of them here).
    assert (refs[kv_dtype] != refs["float32"]) == (kv_dtype != "float16")
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype=kv_dtype, skip_tokenizer_init=True,
              block_size=BS, num_blocks=128)
    assert llm.engine.runner.kv_tensors[0][0].dtype == KV_DTYPES[kv_dtype]
    assert generate(llm) == refs[kv_dtype]


SETTINGS: dict[str, dict[str, object]] = {
    "no caching": dict(num_blocks=128, enable_prefix_caching=False),
    "chunked": dict(num_blocks=128, max_num_batched_tokens=8),
    # A device pool that cannot keep the prefix between requests: its hits come back from the host tier.
    "host tier": dict(num_blocks=26, num_host_blocks=64, max_num_batched_tokens=16),
    "small pool": dict(num_blocks=26, max_num_batched_tokens=32),
}


@pytest.fixture(scope="module")
def kernel_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A tiny Llama of head_dim 64 (what kvpool's fp32 attention kernels take, on AVX2) and its bf16-cache
    reference."""
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-64"), seed=2, hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=1)
    return path, hf_greedy(path, PROMPTS, N_OUT, kv_dtype=torch.bfloat16)


@pytest.mark.parametrize("path", ["torch", "kernels"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_tokens_do_not_depend_on_caching_chunking_tiers_or_preemption(
        tiny_llama_dir: Path, setting: str, refs: dict[str, list[list[int]]], path: str,
        request: pytest.FixtureRequest) -> None:
    if path == "torch":
        model, want, bs = tiny_llama_dir, refs["bfloat16"], BS
    else:
        if not kernels.prefill_supported(64, 8, torch.float32):
            pytest.skip("this CPU lacks what kvpool's fp32 attention kernels need (AVX2 and FMA)")
        (model, want), bs = request.getfixturevalue("kernel_llama"), 8
    kw = dict(SETTINGS[setting])
    kw["num_blocks"] = kw["num_blocks"] * BS // bs  # the same tokens' worth of blocks
    if path == "kernels":
        kw["device"] = "cpu"  # (kvpool's attention kernels are the CPU's; on a GPU torch's ops run)
    llm = LLM(str(model), dtype="float32", kv_cache_dtype="bfloat16", skip_tokenizer_init=True, block_size=bs,
              **kw)  # type: ignore[arg-type]
    runner = llm.engine.runner
    assert (runner.decode_kernel, runner.prefill_kernel) == ((path == "kernels"),) * 2
    assert generate(llm) == want
    kv = llm.engine.kv
    if setting == "host tier":
        assert kv.stats.host_hits > 0 and llm.engine.runner.host_kv_caches[0][0].dtype == torch.bfloat16
    if setting == "small pool":
        assert llm.engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("kv_dtype", ["float16", "fp8", "fp8_e5m2"])
def test_fp16_and_fp8_pages_on_the_kernels(kernel_llama: tuple[Path, list[list[int]]], kv_dtype: str) -> None:
    """fp16 and fp8 pages through the same kernels (widened through F16C), chunked, with prefix hits that
    come back from the host tier."""
    if not kernels.prefill_supported(64, 8, torch.float32):
        pytest.skip("this CPU lacks what kvpool's fp32 attention kernels need (AVX2 and FMA)")
    path = kernel_llama[0]
    want = hf_greedy(path, PROMPTS, N_OUT, kv_dtype=KV_DTYPES[kv_dtype])
    llm = LLM(str(path), dtype="float32", kv_cache_dtype=kv_dtype, skip_tokenizer_init=True, block_size=8, device="cpu",
              num_blocks=14, num_host_blocks=40, max_num_batched_tokens=8)
    runner = llm.engine.runner
    assert runner.decode_kernel and runner.kv_tensors[0][0].dtype == runner.host_kv_caches[0][0].dtype == \
        KV_DTYPES[kv_dtype]
    assert generate(llm) == want
    assert llm.engine.kv.stats.host_hits > 0


@pytest.mark.parametrize(("kv_dtype", "times"), [("bfloat16", 2), ("fp8", 4), ("fp8_e5m2", 4)])
def test_more_blocks_in_the_same_memory(tiny_llama_dir: Path, kv_dtype: str, times: int) -> None:
    def runner(kv_dtype: str) -> object:
        return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype=kv_dtype, skip_tokenizer_init=True,
                   block_size=BS, kv_cache_memory="1MiB", swap_space="1MiB").engine.runner

    fp32, narrow = runner("auto"), runner(kv_dtype)
    assert narrow.bytes_per_block * times == fp32.bytes_per_block  # type: ignore[attr-defined]
    assert narrow.num_blocks == times * fp32.num_blocks == times * (1 << 20) // fp32.bytes_per_block  # type: ignore[attr-defined]
    assert narrow.host_kv_caches[0][0].shape[1] == times * fp32.host_kv_caches[0][0].shape[1]  # type: ignore[attr-defined]


def test_sliding_window_model(tmp_path: Path) -> None:
    """Gemma-3's sliding groups on the hybrid allocator read the rounded window back as well."""
    path = make_tiny_hybrid_gemma3(tmp_path / "gemma3")
    want = hf_greedy(path, PROMPTS, N_OUT, kv_dtype=torch.bfloat16)
    for kw in (dict(num_blocks=200), dict(num_blocks=24 + 5 * 24 + 2, max_num_batched_tokens=32)):
        llm = LLM(str(path), dtype="float32", kv_cache_dtype="bfloat16", skip_tokenizer_init=True, block_size=BS,
                  **kw)  # type: ignore[arg-type]
        assert generate(llm) == want


def test_models_with_state_layers_refuse_it(tmp_path: Path) -> None:
    path = make_tiny_hybrid_lfm2(tmp_path / "lfm2")
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: models with state layers keep their KV cache in "
                                         r"the model's dtype \(float32\); got 'bfloat16'"):
        LLM(str(path), dtype="float32", kv_cache_dtype="bfloat16", skip_tokenizer_init=True, num_blocks=64)


def test_an_unknown_kv_cache_dtype_is_named(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: 'int8' is not one of \['auto', 'bf16', 'bfloat16', "
                                         r"'float16', 'float32', 'fp16', 'fp32', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\]"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="int8", skip_tokenizer_init=True, num_blocks=16)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8"])
def test_the_store_keeps_kv_dtypes_apart(tiny_llama_dir: Path, tmp_path: Path,
                                         refs: dict[str, list[list[int]]], kv_dtype: str) -> None:
    """bf16 (fp8) blocks in a store are hit by a replica of that KV dtype that starts empty, and never read
    by an fp32 one (the store's fingerprint names the KV dtype): each gets its own reference's tokens."""
    def replica(name: str) -> LLM:
        return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype=name, skip_tokenizer_init=True,
                   block_size=BS, num_blocks=64, num_host_blocks=64, write_through=True,
                   kv_store=f"file://{tmp_path}")

    def run(llm: LLM) -> list:
        outs = llm.generate(PROMPTS, SamplingParams.greedy(N_OUT), use_tqdm=False)
        llm.engine.store.close()  # flushes the writes
        return outs

    assert [o.token_ids for o in run(replica(kv_dtype))] == refs[kv_dtype]
    fp32 = replica("auto")
    outs = run(fp32)
    assert [o.token_ids for o in outs] == refs["float32"]
    assert fp32.engine.store.tier.blocks_landed == 0
    narrow = replica(kv_dtype)
    outs = run(narrow)
    assert [o.token_ids for o in outs] == refs[kv_dtype]
    assert narrow.engine.store.tier.blocks_landed > 0
    assert outs[4].num_cached_tokens == (50 - 1) // BS * BS  # the unrelated 50-token prompt, from the store


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8"])
def test_smollm2_with_a_narrow_cache_equals_transformers_rounding_its_cache(smol_dir: Path, kv_dtype: str) -> None:
    """The real model, on the packed fp32 kernels where this CPU runs them, half (fp8: a quarter of) its KV
    cache's bytes."""
    llm = LLM(str(smol_dir), dtype="float32", kv_cache_dtype=kv_dtype, kv_cache_memory="64MiB")
    prompts = [llm.tokenizer.encode("def fibonacci(n):"),
               llm.engine.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])]
    want = hf_greedy(smol_dir, prompts, 16, kv_dtype=KV_DTYPES[kv_dtype])
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams.greedy(16), use_tqdm=False)] == want
    runner = llm.engine.runner
    assert runner.kv_tensors[0][0].dtype == KV_DTYPES[kv_dtype]
    if runner.device.type == "cpu" and kernels.prefill_supported(64, 16, torch.float32):
        assert runner.decode_kernel and runner.prefill_kernel and runner.kv_layout == "packed8"
