"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) against transformers' own logits.

Every prompt token but the first gets its log-probability, its rank and the k most likely tokens' at its
position, equal to transformers' fp32 forward over the prompt. A cached block holds keys and values, not
logits: the request computes its prompt whole (no prefix hit) and still caches its blocks for the next
request; chunked prefill, n > 1 (child 0 computes them, the others share its blocks) and hybrid models give
the same numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.request import Request
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.sampler import TokenLogprobs
from tests.helpers import make_tiny_hybrid_gemma3

PROMPT = list(range(5, 31))  # 26 tokens: 6 full blocks of 4, and 2 tokens


def tiny(model: Path, **kw: object) -> LLM:
    return LLM(str(model), dtype="float32", skip_tokenizer_init=True, num_blocks=64, block_size=4, **kw)


def reference(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """(len - 1, vocab): the log-softmax at each position that predicts the next prompt token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check(got: list[TokenLogprobs | None] | None, ref: torch.Tensor, k: int) -> None:
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    for i, lp in enumerate(got[1:]):
        assert lp is not None and lp.token_id == PROMPT[i + 1]
        want = ref[i, PROMPT[i + 1]].item()
        assert lp.logprob == pytest.approx(want, abs=1e-4)
        assert lp.rank == int((ref[i] > want + 1e-5).sum()) + 1
        top_v, top_i = torch.topk(ref[i], k)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)


@pytest.fixture(scope="module")
def ref(tiny_llama_dir: Path) -> torch.Tensor:
    return reference(tiny_llama_dir, PROMPT)


def test_prompt_logprobs_are_transformers_and_skip_the_hit_but_cache_the_blocks(tiny_llama_dir: Path, ref) -> None:
    llm = tiny(tiny_llama_dir)
    out = llm.generate([PROMPT], SamplingParams.greedy(3, prompt_logprobs=4), use_tqdm=False)[0]
    check(out.prompt_logprobs, ref, 4)
    assert out.num_cached_tokens == 0
    # Its blocks were cached: a request without prompt logprobs hits them, with the same tokens.
    plain = llm.generate([PROMPT], SamplingParams.greedy(3), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 24 and plain.token_ids == out.token_ids and plain.prompt_logprobs is None
    # Cached now, asked again: no hit (the logits are not in the cache), the same numbers.
    again = llm.generate([PROMPT], SamplingParams.greedy(3, prompt_logprobs=0), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == out.token_ids
    assert [None if t is None else (t.token_id, t.logprob, t.rank) for t in again.prompt_logprobs or []] == [
        None if t is None else (t.token_id, t.logprob, t.rank) for t in out.prompt_logprobs or []]
    assert all(t is None or t.top == () for t in again.prompt_logprobs or [])
    llm.engine.kv.check_integrity()


def test_chunked_prefill_gives_every_row_once(tiny_llama_dir: Path, ref) -> None:
    llm = tiny(tiny_llama_dir, max_num_batched_tokens=8)  # 26 prompt tokens in 4 steps
    out = llm.generate([PROMPT], SamplingParams.greedy(2, prompt_logprobs=2), use_tqdm=False)[0]
    check(out.prompt_logprobs, ref, 2)


def test_n_children_share_child_zeros_blocks(tiny_llama_dir: Path, ref) -> None:
    llm = tiny(tiny_llama_dir)
    before = llm.engine.runner.num_tokens_computed
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, n=3, seed=1, prompt_logprobs=1), use_tqdm=False)[0]
    check(out.prompt_logprobs, ref, 1)
    # Child 0 computes the 26 prompt tokens; children 1 and 2 hit its 6 blocks and compute the last 2 each.
    assert llm.engine.runner.num_tokens_computed - before == 26 + 2 + 2
    assert len(out.outputs) == 3


def test_a_one_token_prompt_has_nothing_to_score(tiny_llama_dir: Path) -> None:
    out = tiny(tiny_llama_dir).generate([[7]], SamplingParams.greedy(2, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_recomputed_rows_are_kept_once() -> None:
    """A request preempted mid-prompt computes its rows again from position 0: the first ones stay."""
    req = Request("r", PROMPT, SamplingParams.greedy(2, prompt_logprobs=0))
    assert req.skip_prefix_hit
    assert req.prompt_logprobs_step(0, 8) == (0, PROMPT[1:9])
    assert req.prompt_logprobs_step(24, 26) == (0, PROMPT[25:26])  # (the last row samples instead)
    assert req.prompt_logprobs_step(25, 26) is None
    rows = [TokenLogprobs(t, -1.0, ()) for t in PROMPT[1:9]]
    req.add_prompt_logprobs(0, rows)
    req.add_prompt_logprobs(0, [TokenLogprobs(t, -2.0, ()) for t in PROMPT[1:5]])  # again, after preemption
    req.add_prompt_logprobs(4, [TokenLogprobs(t, -3.0, ()) for t in PROMPT[5:13]])
    assert [t.logprob for t in req.prompt_logprobs[1:]] == [-1.0] * 8 + [-3.0] * 4  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="skip entries"):
        req.add_prompt_logprobs(20, rows)
    req.add_prompt_logprobs(12, [TokenLogprobs(t, 0.0, ()) for t in PROMPT[13:26]])
    assert not req.skip_prefix_hit and req.prompt_logprobs_step(0, 8) is None  # (complete: a resume hits)


def test_hybrid_model_prompt_logprobs_are_transformers(tmp_path: Path) -> None:
    model = make_tiny_hybrid_gemma3(tmp_path / "gemma3")
    want = reference(model, PROMPT)
    llm = tiny(model, max_num_batched_tokens=8)
    out = llm.generate([PROMPT], SamplingParams.greedy(2, prompt_logprobs=3), use_tqdm=False)[0]
    check(out.prompt_logprobs, want, 3)


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_bad_prompt_logprobs_name_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"^prompt_logprobs: must be an int in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
