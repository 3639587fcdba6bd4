"""Log-probabilities of sampled tokens (`SamplingParams.logprobs`) against transformers' own logits.

Each sampled token carries its log-probability and the k most likely tokens' under the model's raw
distribution (log-softmax of the logits, before temperature and top-p), equal to transformers' fp32 forward
over the same tokens; asking for them never changes a token, and a prefix-cache hit gives the same numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams

PROMPT = list(range(5, 31))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)

    def logprobs(tokens: list[int], n_out: int) -> torch.Tensor:
        """(n_out, vocab): the log-softmax at each position that sampled one of the last n_out tokens."""
        with torch.inference_mode():
            logits = model(torch.tensor([tokens])).logits[0].float()
        return torch.log_softmax(logits[len(tokens) - n_out - 1:len(tokens) - 1], dim=-1)

    return logprobs


def check(out, ref_logprobs, k: int) -> None:
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    ref = ref_logprobs(PROMPT + c.token_ids, len(c.token_ids))
    for t, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[t, tok].item(), abs=1e-4)
        want_v, want_i = torch.topk(ref[t], k)
        assert [i for i, _ in lp.top] == want_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(want_v.tolist(), abs=1e-4)


def test_greedy_logprobs_are_transformers_and_change_no_token(llm: LLM, reference) -> None:
    plain = llm.generate([PROMPT], SamplingParams.greedy(6), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None
    out = llm.generate([PROMPT], SamplingParams.greedy(6, logprobs=5), use_tqdm=False)[0]
    assert out.token_ids == plain.token_ids and out.num_cached_tokens == 24  # (a prefix hit: same numbers)
    check(out, reference, 5)
    greedy_top = [lp.top[0][0] for lp in out.outputs[0].logprobs]
    assert greedy_top == out.token_ids  # the argmax is the most likely token
    only = llm.generate([PROMPT], SamplingParams.greedy(3, logprobs=0), use_tqdm=False)[0].outputs[0].logprobs
    assert only is not None and [lp.top for lp in only] == [(), (), ()]


def test_sampled_tokens_get_the_raw_distribution_not_the_tempered_one(llm: LLM, reference) -> None:
    kw = dict(temperature=0.7, top_p=0.9, max_tokens=6, seed=5)
    plain = llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)[0]  # type: ignore[arg-type]
    out = llm.generate([PROMPT], SamplingParams(**kw, logprobs=2), use_tqdm=False)[0]  # type: ignore[arg-type]
    assert out.token_ids == plain.token_ids
    check(out, reference, 2)
    both = llm.generate([PROMPT], SamplingParams(**kw, logprobs=1, n=2), use_tqdm=False)[0]  # type: ignore[arg-type]
    assert [len(c.logprobs or []) for c in both.outputs] == [6, 6]
    assert both.outputs[0].token_ids == out.token_ids  # (choice 0 is seed 5's)
    assert [(lp.token_id, lp.logprob, lp.top) for lp in both.outputs[0].logprobs or []] == [
        (lp.token_id, lp.logprob, lp.top[:1]) for lp in out.outputs[0].logprobs or []]


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_bad_logprobs_name_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"^logprobs: must be an int in \[0, 20\]"):
        SamplingParams(logprobs=value)  # type: ignore[arg-type]
