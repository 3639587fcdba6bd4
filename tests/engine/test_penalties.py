"""Presence, frequency and repetition penalties (vLLM's), against transformers and a hand-written reference.

Repetition: greedy tokens equal transformers' own `generate(repetition_penalty=...)`. Presence and frequency
(no transformers processor): a greedy loop over transformers' logits, penalized by hand as vLLM documents
them, gives the same tokens. The penalties never touch the logprobs (raw, vLLM's default), and a request
without them takes the fast greedy path as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.sampler import apply_penalties

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 11, 12, 13, 5, 6]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)


def test_repetition_penalty_is_transformers(llm: LLM, hf) -> None:
    for rp in (1.5, 0.7):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, repetition_penalty=rp,
                               min_new_tokens=12)[0][len(PROMPT):].tolist()
        got = llm.generate([PROMPT], SamplingParams.greedy(12, repetition_penalty=rp, ignore_eos=True),
                           use_tqdm=False)[0].token_ids
        assert got == want, rp
    plain = llm.generate([PROMPT], SamplingParams.greedy(12, ignore_eos=True), use_tqdm=False)[0].token_ids
    assert plain != got


def test_presence_and_frequency_penalties_follow_their_definition(llm: LLM, hf) -> None:
    presence, frequency = 1.5, 0.8
    tokens = list(PROMPT)
    with torch.inference_mode():
        for _ in range(12):
            logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            out = tokens[len(PROMPT):]
            for t in set(out):
                logits[t] -= presence + frequency * out.count(t)
            tokens.append(int(logits.argmax()))
    params = SamplingParams.greedy(12, presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True,
                                   logprobs=0)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[len(PROMPT):]
    # The logprobs are the model's own (before the penalties): the same as without them for the first token.
    first = llm.generate([PROMPT], SamplingParams.greedy(1, logprobs=0), use_tqdm=False)[0].outputs[0].logprobs
    assert first is not None and out.logprobs is not None
    assert out.logprobs[0].logprob == pytest.approx(first[0].logprob, abs=1e-6)


def test_apply_penalties_by_hand() -> None:
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(row.clone(), ([0, 1, 3, 3, 1], 2), p)  # prompt [0, 1], output [3, 3, 1]
    # repetition over {0, 1, 3}: 2/2, -1*2, 3/2; then output counts {3: 2, 1: 1}: -(0.25*c + 0.5)
    assert got.tolist() == pytest.approx([1.0, -2.0 - 0.75, 0.5, 1.5 - 1.0, -2.0])


@pytest.mark.parametrize(("kw", "message"), [
    (dict(presence_penalty=2.5), r"^presence_penalty: must be in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), r"^frequency_penalty: must be a finite number"),
    (dict(repetition_penalty=0), r"^repetition_penalty: must be > 0 \(1: off\)"),
])
def test_bad_penalties_name_the_field(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_logit_bias_moves_greedy_and_sampled_tokens(llm: LLM) -> None:
    """(OpenAI's logit_bias: added to the logits, greedy requests too; the logprobs stay the model's.)"""
    base = llm.generate([PROMPT], SamplingParams.greedy(4, logprobs=1), use_tqdm=False)[0].outputs[0]
    first, second = base.logprobs[0].top[0][0], None  # type: ignore[index]
    forced = llm.generate([PROMPT], SamplingParams.greedy(4, logit_bias={42: 100}), use_tqdm=False)[0]
    assert forced.token_ids == [42] * 4
    banned = llm.generate([PROMPT], SamplingParams.greedy(1, logit_bias={first: -100}, logprobs=2),
                          use_tqdm=False)[0].outputs[0]
    second = banned.logprobs[0].top[1][0]  # type: ignore[index]
    assert banned.token_ids == [second] and banned.logprobs[0].top[0][0] == first  # type: ignore[index]
    sampled = llm.generate([PROMPT], SamplingParams(max_tokens=6, seed=3, logit_bias={7: 100}), use_tqdm=False)[0]
    assert sampled.token_ids == [7] * 6
    with pytest.raises(ValueError, match=r"^logit_bias: token ids must be in \[0, 256\), got 999"):
        llm.generate([PROMPT], SamplingParams.greedy(1, logit_bias={999: 1}), use_tqdm=False)


def test_min_p_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams.greedy(8, ignore_eos=True), use_tqdm=False)[0].token_ids
    assert llm.generate([PROMPT], SamplingParams(max_tokens=8, seed=5, min_p=1.0, ignore_eos=True),
                        use_tqdm=False)[0].token_ids == greedy


def test_min_tokens_holds_back_the_stop_tokens(llm: LLM) -> None:
    base = llm.generate([PROMPT], SamplingParams.greedy(6, ignore_eos=True), use_tqdm=False)[0].token_ids
    stop = base[0]
    assert llm.generate([PROMPT], SamplingParams.greedy(6, stop_token_ids=[stop]), use_tqdm=False)[0].token_ids == [
        stop]
    held = llm.generate([PROMPT], SamplingParams.greedy(6, stop_token_ids=[stop], min_tokens=4, logprobs=1),
                        use_tqdm=False)[0].outputs[0]
    assert stop not in held.token_ids[:4] and len(held.token_ids) >= 4
    assert held.logprobs is not None and held.logprobs[0].top[0][0] == stop  # (the model's own choice, banned)
    # The same as a bias that rules the token out for those four: the next best each time.
    banned = llm.generate([PROMPT], SamplingParams.greedy(4, logit_bias={stop: -100}), use_tqdm=False)[0].token_ids
    assert held.token_ids[:4] == banned
    with pytest.raises(ValueError, match=r"^min_tokens: must be <= max_tokens \(3\), got 4"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_penalties_ignore_ids_past_the_lm_head_and_never_give_nan() -> None:
    """An image placeholder (an id past the LM head, as Mllama's) in the history is left out, as vLLM does; a
    penalty near 0 does not send a logit to inf (a NaN softmax failed the whole step)."""
    row = torch.tensor([1.0, -1.0, 2.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    got = apply_penalties(row.clone(), ([0, 7, 2, 9, 2, 9], 2), p)  # prompt [0, 7]; output [2, 9, 2, 9]
    assert got.tolist() == [0.5, -1.0, 2.0 / 2 - 2.0, 0.5]
    tiny = apply_penalties(row.clone(), ([0, 2], 0), SamplingParams(repetition_penalty=1e-40))
    assert torch.isfinite(tiny).all() and int(tiny.argmax()) in (0, 2)


def test_min_tokens_when_every_token_stops_and_past_the_room(llm: LLM) -> None:
    every = list(range(256))
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, seed=1, min_tokens=2, stop_token_ids=every),
                       use_tqdm=False)[0]
    # (nothing left to draw instead: the ban gives way, and no stop token ends it before min_tokens, as vLLM's
    # stop check reads it; the second token, a stop token too, ends it)
    assert len(out.token_ids) == 2 and out.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match=r"^min_tokens: must be <= max_tokens \(\d+: the context's room"):
        llm.generate([PROMPT], SamplingParams(max_tokens=None, min_tokens=10**8), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^logit_bias: at most 1024 tokens, got 1025"):
        SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0))
