"""The engine's user-facing behaviour: validation, stop conditions, seeds, aborts (tiny Llama)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.engine.config import parse_size
from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=64, block_size=4)


@pytest.mark.parametrize(("kw", "field"), [
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"), (dict(n=0), "n"),
    (dict(seed="x"), "seed"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kw)


def test_top_k_minus_one_is_off_as_in_vllm() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_bad_prompts(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[1, 2, 999]], use_tqdm=False)  # beyond the vocabulary
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("text", use_tqdm=False)  # no tokenizer
    ctx = llm.engine.max_model_len
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1] * 10], SamplingParams.greedy(ctx), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[1] * ctx], use_tqdm=False)
    # A bad prompt in a batch rejects it whole, without leaking the good ones' blocks.
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], [5000]], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.usage == 0


def test_max_tokens_and_stop_token_ids(llm: LLM) -> None:
    base = llm.generate([[5, 6, 7]], SamplingParams.greedy(12), use_tqdm=False)[0]
    assert len(base.token_ids) == 12 and base.outputs[0].finish_reason == "length"
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = llm.generate([[5, 6, 7]], SamplingParams.greedy(12, stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=1234)
    a = llm.generate([[1, 2, 3]], p, use_tqdm=False)[0].token_ids
    b = llm.generate([[1, 2, 3]], p, use_tqdm=False)[0].token_ids
    c = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=16, seed=99),
                     use_tqdm=False)[0].token_ids
    assert a == b and a != c


def test_abort_frees_everything(llm: LLM) -> None:
    eng = llm.engine
    r1 = eng.add_request([1, 2, 3, 4, 5, 6], SamplingParams.greedy(30))
    r2 = eng.add_request([9, 9, 9], SamplingParams.greedy(30))
    eng.step()
    eng.step()
    assert eng.kv.usage > 0
    out = eng.abort_request(r1.request_id)
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert out.request_id == r1.request_id and out.metrics.finished_time is not None
    assert eng.abort_request(r1.request_id) is None
    assert eng.abort_request(r2.request_id) is not None
    assert not eng.has_unfinished_requests() and eng.kv.usage == 0
    eng.kv.check_integrity()


def test_automatic_request_ids_skip_the_ids_callers_chose(llm: LLM) -> None:
    eng = llm.engine
    first = eng.add_request([1, 2, 3], SamplingParams.greedy(2))
    chosen = eng.add_request([4, 5, 6], SamplingParams.greedy(2), request_id=str(int(first.request_id) + 1))
    auto = eng.add_request([7, 8, 9], SamplingParams.greedy(2))
    assert auto.request_id == str(int(first.request_id) + 2)
    for r in (first, chosen, auto):
        assert eng.abort_request(r.request_id) is not None
    eng.kv.check_integrity()


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size(1.5) == int(1.5 * (1 << 30))
    assert parse_size("1073741824") == 1 << 30
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_size("lots")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_size(0)


def test_stats_and_prefix_cache_reset_through_the_public_api(llm: LLM) -> None:
    eng = llm.engine
    before = eng.stats()
    eng.add_request(list(range(1, 10)), SamplingParams.greedy(3), request_id="s")
    eng.step()  # the prefill: one token
    mid = eng.stats()
    assert (mid.num_running, mid.num_waiting) == (1, 0) and mid.kv_usage > 0
    assert mid.num_generation_tokens == before.num_generation_tokens + 1
    assert not eng.reset_prefix_cache()  # refused while a request holds blocks
    while eng.has_unfinished_requests():
        eng.step()
    after = eng.stats()
    assert after.num_running == 0 and after.num_generation_tokens == before.num_generation_tokens + 3
    assert after.num_blocks == eng.kv.block_pool.num_blocks and after.host_usage is None and not eng.has_host_tier
    assert eng.reset_prefix_cache()
    assert eng.list_pins() == [] and after.num_pins == 0
    # Offline, as in vLLM: the repeated prompt hits before the reset and not after it.
    prompt = list(range(1, 13))
    llm.generate([prompt], SamplingParams.greedy(1), use_tqdm=False)
    assert llm.generate([prompt], SamplingParams.greedy(1), use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], SamplingParams.greedy(1), use_tqdm=False)[0].num_cached_tokens == 0


def test_prompts_in_every_form_a_caller_has(llm: LLM) -> None:
    import numpy as np
    import torch

    want = llm.generate([[5, 6, 7]], SamplingParams.greedy(4), use_tqdm=False)[0].token_ids
    for prompt in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), np.int64(6), np.int64(7)],
                   (5, 6, 7), {"prompt_token_ids": [5, 6, 7]}):
        assert llm.generate(prompt, SamplingParams.greedy(4), use_tqdm=False)[0].token_ids == want, prompt
    for bad in (None, 5, b"hello", [[1, "a"]], [[[1, 2]]], {"ids": [1]}):
        with pytest.raises(TypeError, match=r"^prompts?: "):
            llm.generate(bad, use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^sampling_params: expected SamplingParams, got dict"):
        llm.generate([[1, 2]], [{"max_tokens": 3}], use_tqdm=False)  # type: ignore[list-item]
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.usage == 0


def test_a_field_changed_after_construction_is_checked_again(llm: LLM) -> None:
    sp = SamplingParams.greedy(4)
    sp.stop = 5  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"^stop: a string or a list of strings"):
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    sp = SamplingParams.greedy(4)
    sp.temperature = -1
    with pytest.raises(ValueError, match=r"^temperature"):
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    assert llm.generate([[1, 2, 3]], SamplingParams.greedy(2), use_tqdm=False)[0].token_ids


def test_a_temperature_too_small_to_divide_by_is_greedy(llm: LLM) -> None:
    greedy = llm.generate([[5, 6, 7]], SamplingParams.greedy(6), use_tqdm=False)[0].token_ids
    tiny = llm.generate([[5, 6, 7]], SamplingParams(temperature=1e-300, max_tokens=6), use_tqdm=False)[0]
    assert tiny.token_ids == greedy


@pytest.mark.parametrize("failure", [RuntimeError("a kernel failed"), KeyboardInterrupt()])
def test_a_step_that_fails_leaves_an_engine_that_serves(llm: LLM, failure: BaseException,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    eng = llm.engine
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 1, 2]]
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams.greedy(8), use_tqdm=False)]
    real = eng.runner.execute
    calls = 0

    def fails_on_the_third(*a: object, **kw: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise failure
        return real(*a, **kw)

    monkeypatch.setattr(eng.runner, "execute", fails_on_the_third)
    with pytest.raises(type(failure)):
        llm.generate(prompts, SamplingParams.greedy(8), use_tqdm=False)
    # Nothing left running, nothing cached that the failed step may have half-written, and the next call
    # (no hang) gives the same tokens as before.
    assert not eng.has_unfinished_requests() and eng.kv.usage == 0
    assert eng.kv.block_pool.num_cached_blocks() == 0
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams.greedy(8), use_tqdm=False)] == want


def test_a_reset_between_generate_calls_is_not_refused_by_owed_host_copies(tiny_llama_dir: Path) -> None:
    # With write-through, the last step leaves copies owed to the host tier; the manager alone refuses a
    # reset then. The engine's reset drops them with the blocks they were for.
    llm = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=40, block_size=4,
              num_host_blocks=40, write_through=True)
    prompt = list(range(10, 40))
    llm.generate([prompt], SamplingParams.greedy(3), use_tqdm=False)
    assert llm.engine.kv.host.busy
    assert llm.reset_prefix_cache() is True
    llm.engine.kv.check_integrity()
    out = llm.generate([prompt], SamplingParams.greedy(3), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # forgotten in both tiers


def test_without_chunked_prefill_every_request_fits_one_step(tiny_llama_dir: Path) -> None:
    """Unchunked, a prompt longer than a step's budget would wait for ever: the engine takes none."""
    kw = dict(dtype="float32", skip_tokenizer_init=True, num_blocks=64, block_size=4, enable_chunked_prefill=False,
              max_num_batched_tokens=8)
    llm = LLM(str(tiny_llama_dir), **kw)  # type: ignore[arg-type]
    assert llm.engine.max_model_len == 8
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([list(range(1, 20))], SamplingParams.greedy(2), use_tqdm=False)
    assert len(llm.generate([list(range(1, 7))], SamplingParams.greedy(2), use_tqdm=False)[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens: 8 is less than max_model_len \(32\); without "
                                         r"chunked prefill a request must fit one step"):
        LLM(str(tiny_llama_dir), max_model_len=32, **kw)  # type: ignore[arg-type]


def test_a_max_model_len_past_the_model_is_refused_past_the_pool_lowered(tiny_llama_dir: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Past the model's context, max_model_len is a ValueError (quietly capped, a user who set it would believe
    such requests are served); past what the pool holds for one request, it is lowered, with a warning."""
    kw = dict(dtype="float32", skip_tokenizer_init=True, num_blocks=16, block_size=4)
    derived = LLM(str(tiny_llama_dir), **kw).engine.max_model_len  # type: ignore[arg-type]
    assert derived == 15 * 4  # 15 usable blocks of 4 tokens (block 0 is the null block)
    with caplog.at_level("WARNING", logger="kvpool.engine.engine"):
        assert LLM(str(tiny_llama_dir), max_model_len=derived + 1, **kw).engine.max_model_len == derived  # type: ignore[arg-type]
    assert "max_model_len: 60 tokens, not 61: a request must fit the KV cache alone (16 blocks)" in caplog.text
    with pytest.raises(ValueError, match=r"^max_model_len: 1000000 is more than the model's context of \d+ tokens"):
        LLM(str(tiny_llama_dir), max_model_len=10**6, **kw)  # type: ignore[arg-type]


def test_a_host_tier_needs_caching_and_room_for_a_block(tiny_llama_dir: Path) -> None:
    kw = dict(dtype="float32", skip_tokenizer_init=True, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match=r"^swap_space: the host tier keeps cached blocks, so it needs prefix "
                                         r"caching"):
        LLM(str(tiny_llama_dir), enable_prefix_caching=False, swap_space="64MiB", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^swap_space: '1KiB' holds no KV block \(\d+ bytes each\)"):
        LLM(str(tiny_llama_dir), swap_space="1KiB", **kw)  # type: ignore[arg-type]
    assert LLM(str(tiny_llama_dir), swap_space="1MiB", **kw).engine.has_host_tier  # type: ignore[arg-type]


def test_a_truncated_weights_file_is_the_model_folders_fault(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    weights = next(bad.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:300])
    with pytest.raises(ValueError, match=r"^model: .*model\.safetensors is not a readable safetensors file"):
        LLM(str(bad), dtype="float32", skip_tokenizer_init=True, num_blocks=16)


@pytest.mark.parametrize(("kw", "message"), [
    # Tensors past the memory of the device they go on (the machine's, or a GPU's): a traceback from torch's
    # allocator, or (zeroed, so every page is touched) the kernel killing the process.
    (dict(swap_space="1000000TiB"), r"^swap_space: \d+ host blocks \([\d.]+ GiB\) are more than this machine's memory"),
    (dict(num_blocks=10**13),
     r"^kv_cache_memory: \d+ blocks \([\d.]+ GiB\) are more than (this machine's|cuda:\d+'s) memory"),
    (dict(enable_lora=True, max_lora_rank=10**8),
     r"^max_loras, max_lora_rank: 1 adapter slots of rank 100000000 need [\d.]+ GiB of buffers, more than half "
     r"(this machine's|cuda:\d+'s) memory"),
    (dict(enable_lora=True, max_loras=10**9), r"^max_loras, max_lora_rank: 1000000000 adapter slots"),
])
def test_memory_no_machine_has_is_a_value_error(tiny_llama_dir: Path, kw: dict, message: str) -> None:
    args = {"dtype": "float32", "skip_tokenizer_init": True, "num_blocks": 16, "block_size": 4, **kw}
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), **args)  # type: ignore[arg-type]


def test_stop_strings_need_the_tokenizer_and_n_is_an_int(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"^stop: stop strings need the tokenizer .*use stop_token_ids"):
        llm.generate([[1, 2, 3]], SamplingParams.greedy(4, stop=["ab"]), use_tqdm=False)
    for n in (True, 1.0):
        with pytest.raises(ValueError, match=r"^n: must be an int in \[1, 128\]"):
            SamplingParams(n=n)  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()


def test_the_step_budget_defaults_to_the_use(tiny_llama_dir: Path) -> None:
    """Offline (LLM) 4096 tokens a step, an engine built directly (kvpool serve) 2048, as vLLM-CPU; a given
    budget is kept either way, and the CLI passes none unless one is given."""
    from kvpool.cli import build_parser, engine_kwargs
    from kvpool.engine.engine import LLMEngine

    kw = dict(dtype="float32", skip_tokenizer_init=True, num_blocks=64, block_size=4)
    assert LLM(str(tiny_llama_dir), **kw).engine.scheduler.max_num_batched_tokens == 4096  # type: ignore[arg-type]
    assert LLMEngine(model=str(tiny_llama_dir), **kw).scheduler.max_num_batched_tokens == 2048
    assert LLM(str(tiny_llama_dir), max_num_batched_tokens=512,  # type: ignore[arg-type]
               **kw).engine.scheduler.max_num_batched_tokens == 512
    assert engine_kwargs(build_parser().parse_args(["serve"]))["max_num_batched_tokens"] is None
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens: must be an int >= 1 or None, got 0"):
        LLM(str(tiny_llama_dir), max_num_batched_tokens=0, **kw)  # type: ignore[arg-type]


def test_a_model_folder_without_a_tokenizer_is_named(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^model: .* has no tokenizer kvpool can load .*skip_tokenizer_init=True"):
        LLM(str(tiny_llama_dir), dtype="float32", num_blocks=16)


def test_kernels_switch_reads_the_usual_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.runner import kernels

    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("KVPOOL_KERNELS", off)
        kernels._library.cache_clear()
        assert kernels._library() is False
    monkeypatch.setenv("KVPOOL_KERNELS", "maybe")
    kernels._library.cache_clear()
    with pytest.raises(ValueError, match=r"^KVPOOL_KERNELS: 0 \(off\) or 1 \(on\), got 'maybe'"):
        kernels._library()
    monkeypatch.delenv("KVPOOL_KERNELS")
    kernels._library.cache_clear()
