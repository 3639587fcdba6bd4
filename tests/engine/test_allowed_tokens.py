"""vLLM's allowed_token_ids (the only tokens a request may draw) and truncate_prompt_tokens (the prompt's last
tokens only), against transformers' own logits and against the truncated prompt sent as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams

PROMPT = list(range(5, 31))
ALLOWED = [7, 19, 42, 101, 200]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=64, block_size=4,
               max_model_len=40)


def test_greedy_takes_the_argmax_among_the_allowed_tokens(llm: LLM, tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    out = llm.generate([PROMPT], SamplingParams.greedy(5, allowed_token_ids=ALLOWED, logprobs=1),
                       use_tqdm=False)[0]
    tokens = list(PROMPT)
    for tok, lp in zip(out.token_ids, out.outputs[0].logprobs or [], strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        assert tok == ALLOWED[int(logits[ALLOWED].argmax())]
        # (logprobs stay the model's own distribution: its top token need not be allowed)
        assert lp.top[0][0] == int(logits.argmax())
        tokens.append(tok)
    plain = llm.generate([PROMPT], SamplingParams.greedy(5), use_tqdm=False)[0]
    assert not set(plain.token_ids) <= set(ALLOWED)  # (the restriction changed something)


def test_sampled_tokens_stay_in_the_allowed_set(llm: LLM) -> None:
    sp = SamplingParams(temperature=1.5, max_tokens=12, seed=3, allowed_token_ids=ALLOWED[:2], ignore_eos=True)
    assert set(llm.generate([PROMPT], sp, use_tqdm=False)[0].token_ids) <= set(ALLOWED[:2])


def test_truncation_runs_the_prompts_last_tokens(llm: LLM) -> None:
    cut = llm.generate([PROMPT], SamplingParams.greedy(4, truncate_prompt_tokens=10), use_tqdm=False)[0]
    alone = llm.generate([PROMPT[-10:]], SamplingParams.greedy(4), use_tqdm=False)[0]
    assert cut.prompt_token_ids == PROMPT[-10:] and cut.token_ids == alone.token_ids
    long = list(range(5, 55))  # 50 tokens: over the context of 40
    fit = llm.generate([long], SamplingParams.greedy(1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert fit.prompt_token_ids == long[-39:]  # (what the context holds, one token left to generate)
    same = llm.generate([PROMPT], SamplingParams.greedy(2, truncate_prompt_tokens=39), use_tqdm=False)[0]
    assert same.prompt_token_ids == PROMPT
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens: must be below the context's length \(40"):
        llm.generate([PROMPT], SamplingParams.greedy(1, truncate_prompt_tokens=40), use_tqdm=False)


def test_allowed_stop_tokens_do_not_end_it_before_min_tokens(llm: LLM) -> None:
    """Only a stop token allowed, min_tokens 3: the ban gives way (nothing else may be drawn), and the stop
    token ends the answer only once min_tokens are out, as vLLM's stop check reads it."""
    sp = SamplingParams.greedy(5, allowed_token_ids=[7], stop_token_ids=[7], min_tokens=3)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert out.token_ids == [7, 7, 7] and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kw,msg", [
    ({"allowed_token_ids": []}, "allowed_token_ids: a non-empty list"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids: every entry"),
    ({"allowed_token_ids": [1, True]}, "allowed_token_ids: every entry"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: an int >= 1, or -1"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens: an int >= 1, or -1"),
])
def test_bad_values_name_the_field(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_an_allowed_id_past_the_lm_head_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"allowed_token_ids: token ids must be in \[0, "):
        llm.generate([PROMPT], SamplingParams.greedy(1, allowed_token_ids=[5, 10**6]), use_tqdm=False)
