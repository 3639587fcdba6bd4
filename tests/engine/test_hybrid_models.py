"""Models whose layers differ, on the hybrid allocator, token for token against transformers: a
Mistral-style model (every layer a sliding window: one group that keeps only the window's blocks) and
Gemma-3 (five sliding layers per full one: a full group and sliding groups in one pool). Exact with
prefix caching on and off, chunked prefill, and a pool small enough to evict and preempt."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY_VOCAB, hf_greedy, make_tiny_model

from kvpool.core.kv_cache_spec import SlidingWindowSpec
from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams

WINDOW = 24
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, eos_token_id=None,
              bos_token_id=None, pad_token_id=None, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "MistralConfig", "MistralForCausalLM",
                           num_hidden_layers=2, tie_word_embeddings=False, **COMMON)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "Gemma3TextConfig", "Gemma3ForCausalLM",
                           num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"], **COMMON)


# Shared prefixes longer than the window, so hits must rely on the window's blocks only.
PREFIX = [(7 * i + 3) % TINY_VOCAB for i in range(70)]
PROMPTS = [[*PREFIX, 11, 12, 13], [*PREFIX, 21, 22], PREFIX[:40] + [5] * 9, [9] * 30]
N_OUT = 20

SETTINGS = {
    "caching": dict(num_blocks=200),
    "no caching": dict(num_blocks=200, enable_prefix_caching=False),
    "chunked": dict(num_blocks=200, max_num_batched_tokens=16),
    "small pool": dict(max_num_batched_tokens=32),  # num_blocks per model: SMALL_POOL
    # The uniform allocator (every layer's blocks kept): the baseline of `bench prefix`, same tokens.
    "uniform allocator": dict(num_blocks=200, hybrid_allocator=False),
}
# Just over what the longest request (93 tokens) holds alone: requests together must evict and preempt.
SMALL_POOL = {"mistral": 26, "gemma3": 24 + 5 * 24 + 2}


@pytest.fixture(scope="module")
def references(mistral_dir: Path, gemma3_dir: Path) -> dict[str, list[list[int]]]:
    return {"mistral": hf_greedy(mistral_dir, PROMPTS, N_OUT), "gemma3": hf_greedy(gemma3_dir, PROMPTS, N_OUT)}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("model", ["mistral", "gemma3"])
def test_greedy_tokens_equal_transformers(model: str, setting: str, request: pytest.FixtureRequest,
                                          references: dict[str, list[list[int]]]) -> None:
    path = request.getfixturevalue(f"{model}_dir")
    kw = dict(SETTINGS[setting])
    kw.setdefault("num_blocks", SMALL_POOL[model])
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=4, **kw)
    # One at a time first (later prompts hit earlier ones' blocks), then all together.
    alone = [llm.generate([p], SamplingParams.greedy(N_OUT), use_tqdm=False)[0] for p in PROMPTS]
    together = llm.generate(PROMPTS, SamplingParams.greedy(N_OUT), use_tqdm=False)
    assert [o.token_ids for o in alone] == references[model]
    assert [o.token_ids for o in together] == references[model]
    llm.engine.kv.check_integrity()
    if setting == "uniform allocator":
        assert [type(s).__name__ for s in llm.engine.kv.specs] == ["FullAttentionSpec"]
        assert alone[1].num_cached_tokens == 68
    if setting == "small pool":
        assert llm.engine.scheduler.stats.num_preemptions > 0
    if setting == "caching":
        # The second prompt shares 70 tokens with the first: 17 full blocks of 4 are a hit in every
        # group (the sliding groups need only the last ceil(23/4) = 6 blocks before the hit point).
        assert alone[1].num_cached_tokens == 68
        assert alone[2].num_cached_tokens == 40


def test_sliding_groups_hold_only_the_window(gemma3_dir: Path) -> None:
    llm = LLM(str(gemma3_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=200)
    eng = llm.engine
    # Six layers, five sliding and one full: six groups of one layer, in layer order.
    assert [type(s).__name__ for s in eng.kv.specs] == ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"]
    eng.add_request(PREFIX + [1] * 30, SamplingParams.greedy(5), request_id="r")
    eng.step()  # the whole 100-token prompt in one step
    eng.step()  # one decode: out-of-window blocks are released as the table grows
    *sliding, full = eng.kv.get_block_ids("r")
    assert len(full) == 26 and 0 not in full  # full attention keeps every block
    # Position 100 sees 77..100: blocks 19..25. Block 18 is held too, in the window before the prompt's
    # last boundary (a repeat of this prompt hits at 24 blocks); blocks 0..17 are the null block.
    for t in sliding:
        assert t[:18] == [0] * 18 and 0 not in t[18:] and len(t) == 26
    used = eng.kv.block_pool.num_usable_blocks - eng.kv.get_num_free_blocks()
    assert used == 26 + 5 * 8


def test_a_request_of_max_model_len_fits_alone_after_a_cut_hit(gemma3_dir: Path) -> None:
    # The engine takes requests up to max_model_len on the promise that each fits the pool alone (it can
    # always finish once the others are preempted). Here the pool is the smallest that admits 120 tokens,
    # and the request's hit is cut short: the full group has 15 blocks of its prefix cached, the sliding
    # groups only the window before block 7 (another request's prompt end). Each sliding group then holds
    # four windows at once (before the hit, the shared prefix's end, the prompt's end, and the current
    # one); counted as three, the request ran out of blocks alone and preempted itself.
    chunk = 4
    roomy = LLM(str(gemma3_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=400)
    specs = roomy.engine.kv.specs
    num_blocks = 1 + sum(s.max_blocks_held(120, chunk) for s in specs)
    llm = LLM(str(gemma3_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=num_blocks,
              max_num_batched_tokens=chunk)
    eng = llm.engine
    assert 120 <= eng.max_model_len < 124
    base = [(5 * i + 1) % TINY_VOCAB for i in range(100)]
    filler = [(11 * i + 7) % TINY_VOCAB for i in range(140)]
    greedy = SamplingParams.greedy
    llm.generate([base[:29]], greedy(1), use_tqdm=False)  # the sliding groups keep the window before block 7
    llm.generate([base], greedy(1), use_tqdm=False)  # the full group caches 25 blocks
    llm.generate([filler[:40]], greedy(1), use_tqdm=False)  # evicts the sliding blocks no anchor kept
    prompt = base[:60] + filler[100:132]
    n_out = eng.max_model_len - len(prompt)
    peak = 0
    schedule = eng.scheduler.schedule

    def watched() -> object:
        nonlocal peak
        out = schedule()
        for r in eng.scheduler.running:
            for m in eng.kv.managers:
                held = sum(1 for b in m.req_to_blocks.get(r.request_id, ()) if not b.is_null)
                assert held <= m.spec.max_blocks_held(eng.max_model_len, chunk)
                if isinstance(m.spec, SlidingWindowSpec):
                    peak = max(peak, held)
        return out

    eng.scheduler.schedule = watched  # type: ignore[method-assign]
    before = eng.scheduler.stats.num_preemptions
    out = llm.generate([prompt], greedy(n_out), use_tqdm=False)[0]
    assert out.num_cached_tokens == 7 * 4  # the hit was cut at the sliding groups' window
    assert eng.scheduler.stats.num_preemptions == before
    assert peak > 3 * 6 + 1 + 1, peak  # more than the three windows (and a block) counted before
    assert out.token_ids == hf_greedy(gemma3_dir, [prompt], n_out)[0]
    eng.kv.check_integrity()


def test_a_model_of_sliding_layers_only_counts_no_shared_prefix_window(mistral_dir: Path) -> None:
    # One group: no other group cuts its hits, so its bound is one window (6 blocks) under a hybrid's.
    llm = LLM(str(mistral_dir), dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=200,
              max_num_batched_tokens=4)
    (spec,) = llm.engine.kv.specs
    assert isinstance(spec, SlidingWindowSpec) and spec.only_group
    assert spec.max_blocks_held(400, 4) == 2 * 6 + 1 + 8
