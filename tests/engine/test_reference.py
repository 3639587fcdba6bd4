"""Greedy tokens identical to transformers' generate on the same weights (fp32)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers import TINY_VOCAB, hf_greedy, make_tiny_model

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


def legacy_rope_config(path: Path, **legacy: object) -> Path:
    """Rewrite a saved config's RoPE in the form configs took before transformers 5 (and the hub still holds):
    a top-level `rope_theta` (`rope_local_base_freq` for Gemma-3's sliding layers) and `rope_scaling`."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    full = rope.get("full_attention", rope)
    cfg.update(rope_theta=full["rope_theta"], **legacy)
    if "sliding_attention" in rope:
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    (path / "config.json").write_text(json.dumps(cfg))
    return path


TINY = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, initializer_range=0.3, eos_token_id=None, bos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False)
LINEAR_8 = {"rope_type": "linear", "factor": 8.0}
VARIANTS = {
    # Qwen2: q, k and v projections with a bias though its config names none; the output projection without.
    "qwen2": lambda d: make_tiny_model(d, "Qwen2Config", "Qwen2ForCausalLM", num_hidden_layers=2, **TINY),
    # Llama's attention_bias: all four projections with a bias.
    "llama attention_bias": lambda d: make_tiny_model(d, "LlamaConfig", "LlamaForCausalLM", num_hidden_layers=2,
                                                      attention_bias=True, **TINY),
    "llama linear rope": lambda d: make_tiny_model(d, "LlamaConfig", "LlamaForCausalLM", num_hidden_layers=2,
                                                   rope_parameters={"rope_theta": 10000.0, **LINEAR_8}, **TINY),
    "lfm2 linear rope": lambda d: make_tiny_model(
        d, "Lfm2Config", "Lfm2ForCausalLM", num_hidden_layers=4, conv_L_cache=3, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        rope_parameters={"rope_theta": 10000.0, **LINEAR_8}, **{**TINY, "tie_word_embeddings": True}),
    # Gemma-3 4B and up: linear scaling on the full-attention layers, in the pre-5 config form.
    "gemma3 legacy linear rope": lambda d: legacy_rope_config(make_tiny_model(
        d, "Gemma3TextConfig", "Gemma3ForCausalLM", num_hidden_layers=4, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 2,
        **{**TINY, "tie_word_embeddings": True}), rope_scaling=LINEAR_8),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(variant: str, tmp_path: Path) -> None:
    """Biases and RoPE scaling read from every config form a checkpoint may have (they loaded with an
    error, or ran with the scaling silently dropped: other tokens than transformers')."""
    model_dir = VARIANTS[variant](tmp_path / "m")
    rng = random.Random(4)
    # Up to 300 positions: far past the window, where scaled and unscaled angles part.
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (20, 150, 300)]
    expected = hf_greedy(model_dir, prompts, 12)
    llm = LLM(str(model_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=128)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams.greedy(12), use_tqdm=False)] == expected


def test_an_unsupported_rope_type_is_refused_by_name(tmp_path: Path) -> None:
    model_dir = legacy_rope_config(make_tiny_model(tmp_path / "m", "LlamaConfig", "LlamaForCausalLM",
                                                   num_hidden_layers=1, **TINY),
                                   rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match=r"config\.rope_parameters: rope_type 'yarn' is not supported yet"):
        LLM(str(model_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=16)


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
    assert out.outputs[0].stop_reason is None  # EOS, as vLLM reports it (a stop_token_ids entry is named)
    assert out.metrics is not None and out.metrics.first_token_time is not None
    assert out.metrics.arrival_time <= out.metrics.first_token_time <= out.metrics.finished_time
    # Content as text parts: the parts a line apart, as vLLM joins them (and as the server does).
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital of France?"}]
    eng = smol_llm.engine
    assert eng.apply_chat_template([{"role": "user", "content": parts}]) == eng.apply_chat_template(
        [{"role": "user", "content": "What is\nthe capital of France?"}])


def test_a_stop_tokens_text_is_left_out_unless_asked_for(smol_llm: LLM) -> None:
    """As vLLM: the token that ended the request stays in its ids, and its text (a newline here) is not in
    the text unless include_stop_str_in_output; the stream's deltas add up to the same text."""
    prompt = "The capital of France is"
    full = smol_llm.generate(prompt, SamplingParams.greedy(12), use_tqdm=False)[0]
    assert "\n" in full.text
    newline = 198
    out = smol_llm.generate(prompt, SamplingParams.greedy(12, stop_token_ids=[newline]), use_tqdm=False)[0]
    assert out.token_ids[-1] == newline and out.outputs[0].stop_reason == newline
    assert out.text == full.text[: full.text.index("\n")] and out.text
    keep = SamplingParams.greedy(12, stop_token_ids=[newline], include_stop_str_in_output=True)
    kept = smol_llm.generate(prompt, keep, use_tqdm=False)[0]
    assert kept.text == out.text + "\n"


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
