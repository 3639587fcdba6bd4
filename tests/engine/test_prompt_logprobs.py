"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) against transformers' own logits.

Every prompt token but the first gets its log-probability, its rank and the k most likely tokens' at its
position, equal to transformers' fp32 forward over the prompt. A cached block holds keys and values, not
logits: the request hits only the blocks whose last hidden states the prompt-row cache holds (written by
earlier requests that scored the same prefix), and computes the rest; with no row cache it computes its
prompt whole, as vLLM's. Its blocks are cached for the next request either way. Chunked prefill, n > 1
(child 0 computes them, the others share its blocks) and hybrid models give the same numbers.
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


def entries(lps) -> list:
    return [None if t is None else (t.token_id, t.logprob, t.rank) for t in lps or []]


def test_prompt_logprobs_are_transformers_and_hit_what_the_row_cache_holds(tiny_llama_dir: Path, ref) -> None:
    llm = tiny(tiny_llama_dir)
    plain = llm.generate([PROMPT], SamplingParams.greedy(3), use_tqdm=False)[0]
    # Its KV blocks are cached, but not their rows: no hit.
    out = llm.generate([PROMPT], SamplingParams.greedy(3, prompt_logprobs=4), use_tqdm=False)[0]
    check(out.prompt_logprobs, ref, 4)
    assert out.num_cached_tokens == 0 and out.token_ids == plain.token_ids and plain.prompt_logprobs is None
    rows = llm.engine.runner.prompt_rows
    assert rows is not None and len(rows) == 6 and rows.rows_written == 24  # the 6 full blocks' rows
    # Asked again: a hit on the 6 blocks, their rows scored from the cache, the same numbers.
    again = llm.generate([PROMPT], SamplingParams.greedy(3, prompt_logprobs=0), use_tqdm=False)[0]
    assert again.num_cached_tokens == 24 and again.token_ids == out.token_ids and rows.rows_read == 24
    assert entries(again.prompt_logprobs) == entries(out.prompt_logprobs)
    assert all(t is None or t.top == () for t in again.prompt_logprobs or [])
    # A prompt that branches off after 3 blocks hits those 3 (their rows are the same prefix's).
    branch = [*PROMPT[:12], 40, 41, 42, 43, 44, 45]
    b = llm.generate([branch], SamplingParams.greedy(2, prompt_logprobs=1), use_tqdm=False)[0]
    assert b.num_cached_tokens == 12
    check_prefix = entries(b.prompt_logprobs)[:12]
    assert check_prefix == entries(out.prompt_logprobs)[:12]
    want = reference(tiny_llama_dir, branch)
    assert [t.logprob for t in b.prompt_logprobs[12:]] == pytest.approx(  # type: ignore[index, union-attr]
        [want[i - 1, branch[i]].item() for i in range(12, len(branch))], abs=1e-4)
    llm.engine.kv.check_integrity()
    # reset_prefix_cache forgets the rows with the blocks (after new weights, they would be the old model's).
    assert llm.engine.reset_prefix_cache() and len(rows) == 0


def test_without_a_row_cache_the_prompt_is_computed_whole_as_vllm(tiny_llama_dir: Path, ref) -> None:
    llm = tiny(tiny_llama_dir, prompt_rows_cache=0)
    assert llm.engine.runner.prompt_rows is None
    first = llm.generate([PROMPT], SamplingParams.greedy(3, prompt_logprobs=2), use_tqdm=False)[0]
    again = llm.generate([PROMPT], SamplingParams.greedy(3, prompt_logprobs=2), use_tqdm=False)[0]
    assert first.num_cached_tokens == again.num_cached_tokens == 0
    check(again.prompt_logprobs, ref, 2)
    # Its blocks were cached all the same: a plain request hits them.
    assert llm.generate([PROMPT], SamplingParams.greedy(3), use_tqdm=False)[0].num_cached_tokens == 24


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
    assert req.max_hit_blocks == 0  # (no row cache: no hit)
    step = req.prompt_logprobs_step(0, 8)
    assert step is not None and (step.first, step.targets, step.read, step.write) == (0, PROMPT[1:9], [], [])
    rows = [TokenLogprobs(t, -1.0, ()) for t in PROMPT[1:9]]
    req.add_prompt_logprobs(0, rows)
    req.add_prompt_logprobs(0, [TokenLogprobs(t, -2.0, ()) for t in PROMPT[1:5]])  # again, after preemption
    req.add_prompt_logprobs(4, [TokenLogprobs(t, -3.0, ()) for t in PROMPT[5:13]])
    assert [t.logprob for t in req.prompt_logprobs[1:]] == [-1.0] * 8 + [-3.0] * 4  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="skip entries"):
        req.add_prompt_logprobs(20, rows)
    with pytest.raises(RuntimeError, match="neither scored nor cached"):
        req.prompt_logprobs_step(16, 20)  # (a hit past what it scored, with no row cache)
    req.add_prompt_logprobs(12, [TokenLogprobs(t, 0.0, ()) for t in PROMPT[13:26]])
    assert req.max_hit_blocks is None and req.prompt_logprobs_step(0, 8) is None  # (complete: a resume hits)


def test_the_steps_read_and_write_rows_by_block(tiny_llama_dir: Path) -> None:
    """With a row cache: a hit of 2 blocks reads their rows and scores from position 0; the computed chunk
    writes the full prompt blocks it touches (the partial last one has no hash: never)."""
    llm = tiny(tiny_llama_dir)
    req = llm.engine.make_request(PROMPT, SamplingParams.greedy(1, prompt_logprobs=0))
    assert req.prompt_rows is llm.engine.runner.prompt_rows
    step = req.prompt_logprobs_step(8, 26)
    assert step is not None and step.first == 0 and step.targets == PROMPT[1:26]  # (the last row samples)
    assert step.read == req.block_hashes[:2]
    assert step.write == [(req.block_hashes[i], 4 * i) for i in range(2, 6)]
    mid = req.prompt_logprobs_step(0, 10)
    assert mid is not None and [p for _, p in mid.write] == [0, 4, 8] and mid.read == []


def test_hybrid_model_prompt_logprobs_are_transformers(tmp_path: Path) -> None:
    model = make_tiny_hybrid_gemma3(tmp_path / "gemma3")
    want = reference(model, PROMPT)
    llm = tiny(model, max_num_batched_tokens=8)
    out = llm.generate([PROMPT], SamplingParams.greedy(2, prompt_logprobs=3), use_tqdm=False)[0]
    check(out.prompt_logprobs, want, 3)
    again = llm.generate([PROMPT], SamplingParams.greedy(2, prompt_logprobs=3), use_tqdm=False)[0]
    assert again.num_cached_tokens == 24 and again.token_ids == out.token_ids  # (every group serves the hit)
    check(again.prompt_logprobs, want, 3)


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_bad_prompt_logprobs_name_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"^prompt_logprobs: must be an int in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_contexts_under_pressure_score_as_a_cold_engine(tiny_llama_dir: Path, seed: int) -> None:
    """lm-eval's shape: several continuations over a few shared contexts, all in flight together, with a
    small KV pool (preemption), a small step budget (chunks) and a row cache that holds a few blocks
    (evictions mid-run): every prompt's log-probabilities and tokens are a cold engine's, one at a time."""
    import random

    rng = random.Random(seed)
    contexts = [[rng.randrange(5, 250) for _ in range(rng.randrange(9, 30))] for _ in range(3)]
    prompts = [c + [rng.randrange(5, 250) for _ in range(rng.randrange(1, 6))] for c in contexts for _ in range(3)]
    rng.shuffle(prompts)
    params = [SamplingParams.greedy(rng.randrange(1, 4), prompt_logprobs=rng.randrange(0, 3)) for _ in prompts]
    cold = tiny(tiny_llama_dir, enable_prefix_caching=False)
    want = [cold.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params, strict=True)]
    hot = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=10, block_size=4,
              max_num_batched_tokens=12, prompt_rows_cache=8 * 4 * 64 * 4)  # (8 blocks of rows, hidden 64)
    got = hot.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert [None if t is None else (t.token_id, t.rank, t.top and [i for i, _ in t.top]) for t in g.prompt_logprobs
                ] == [None if t is None else (t.token_id, t.rank, t.top and [i for i, _ in t.top])
                      for t in w.prompt_logprobs]
        assert [t.logprob for t in g.prompt_logprobs[1:]] == pytest.approx([t.logprob for t in w.prompt_logprobs[1:]],
                                                                           abs=1e-5)
    rows = hot.engine.runner.prompt_rows
    assert sum(o.num_cached_tokens for o in got) > 0 and rows.rows_read > 0
    assert rows.rows_written > 8 * 4 and hot.engine.scheduler.stats.num_preemptions > 0  # (evictions, preemptions)
    hot.engine.kv.check_integrity()


def test_continuations_sent_together_wait_for_the_context_rows(tiny_llama_dir: Path, ref) -> None:
    """Four continuations of one 24-token context, sent at once: the first computes the context; the others
    wait a step for its rows instead of computing it too, then hit it (6 blocks). Without a row cache each
    computes its whole prompt, in the same step."""
    context = PROMPT[:24]
    prompts = [[*context, 40 + i, 50 + i] for i in range(4)]
    sp = SamplingParams.greedy(1, prompt_logprobs=1)
    for size, cached, computed in ((None, [0, 24, 24, 24], 26 + 3 * 2), (0, [0, 0, 0, 0], 4 * 26)):
        llm = tiny(tiny_llama_dir) if size is None else tiny(tiny_llama_dir, prompt_rows_cache=size)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.num_cached_tokens for o in outs] == cached
        assert llm.engine.scheduler.stats.num_prompt_tokens == computed
        for o in outs:  # (the context's rows are PROMPT's: its reference applies)
            assert entries(o.prompt_logprobs)[:24] == entries(outs[0].prompt_logprobs)[:24]
        check_rows = [t.logprob for t in outs[0].prompt_logprobs[1:24]]  # type: ignore[index]
        assert check_rows == pytest.approx([ref[i, PROMPT[i + 1]].item() for i in range(23)], abs=1e-4)


def test_a_cache_too_small_for_two_contexts_keeps_the_head_of_one(tiny_llama_dir: Path) -> None:
    """Two 6-block contexts scored in turn through a row cache of 9 blocks: each prompt's tail goes first, so
    the older context keeps its first blocks and later requests hit them (evicting each prompt's first blocks,
    written first, left no hit at all)."""
    a, b = PROMPT[:24], [t + 100 for t in PROMPT[:24]]
    llm = tiny(tiny_llama_dir, prompt_rows_cache=9 * 4 * 64 * 4)  # (hidden 64, float32)
    sp = SamplingParams.greedy(1, prompt_logprobs=0)
    hits = [llm.generate([[*p, 7]], sp, use_tqdm=False)[0].num_cached_tokens for p in (a, b, a, b, a, b)]
    assert hits[:2] == [0, 0] and all(h > 0 for h in hits[2:]), hits


def test_no_wait_for_rows_the_cache_cannot_hold(tiny_llama_dir: Path) -> None:
    """Continuations of a context longer than the row cache run together, as with no cache (waiting would
    serialize them for rows evicted before anyone reads them)."""
    prompts = [[*PROMPT[:24], 40 + i, 50 + i] for i in range(4)]
    sp = SamplingParams.greedy(1, prompt_logprobs=0)
    llm = tiny(tiny_llama_dir, prompt_rows_cache=3 * 4 * 64 * 4)  # (3 blocks of the context's 6)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert len({o.metrics.first_scheduled_time for o in outs}) == 1  # (all admitted in the first step)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0]


def test_batch_invariant_hits_score_bit_for_bit_as_a_cold_run(tiny_llama_dir: Path) -> None:
    """Continuations sent together (the later ones score the context from the row cache, with their own rows)
    give exactly what each gives alone on a cold engine."""
    cold = tiny(tiny_llama_dir, batch_invariant=True, enable_prefix_caching=False)
    hot = tiny(tiny_llama_dir, batch_invariant=True)
    prompts = [[*PROMPT[:24], 40 + i, 50 + i] for i in range(3)]
    sp = SamplingParams.greedy(2, prompt_logprobs=0)
    want = [cold.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    got = hot.generate(prompts, sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in got] == [0, 24, 24]
    assert [entries(o.prompt_logprobs) for o in got] == [entries(o.prompt_logprobs) for o in want]
