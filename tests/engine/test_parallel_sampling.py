"""n > 1: n sequences from one prompt, as child requests that share the prompt's blocks (tiny Llama).

What must hold: each choice is exactly the sequence a request of its own would give (greedy: n=1's tokens;
seeded: child i is the request with seed + i), the prompt is computed once with prefix caching on, an abort
stops every sequence and leaks no block, and the children's ids cannot be taken while they run.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpool.engine.llm import LLM
from kvpool.engine.parallel_sampling import child_id, child_params
from kvpool.engine.sampling_params import SamplingParams

PROMPT = list(range(5, 31))  # 26 tokens: 6 full blocks of 4 and 2 tokens
BLOCKS = 6


def make(tiny_llama_dir: Path, **kw: object) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=4,
               **{"num_blocks": 64, **kw})  # type: ignore[arg-type]


def test_greedy_choices_are_the_single_answer_and_the_prompt_is_computed_once(tiny_llama_dir: Path) -> None:
    llm = make(tiny_llama_dir)
    out = llm.generate([PROMPT], SamplingParams.greedy(8, n=3), use_tqdm=False)[0]
    # The first child computes all 26 prompt tokens; the others, admitted in the same step, hit its 6 full
    # blocks and compute only their last 2 tokens.
    assert llm.engine.scheduler.stats.num_prompt_tokens == 26 + 2 * 2
    assert [o.index for o in out.outputs] == [0, 1, 2] and out.finished and out.request_id == "0"
    single = llm.generate([PROMPT], SamplingParams.greedy(8), use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [single.token_ids] * 3
    assert [o.finish_reason for o in out.outputs] == ["length"] * 3
    assert out.num_cached_tokens == 0 and single.num_cached_tokens == BLOCKS * 4
    assert llm.engine.stats().kv_usage == 0.0
    llm.engine.kv.check_integrity()

    no_cache = make(tiny_llama_dir, enable_prefix_caching=False)
    again = no_cache.generate([PROMPT], SamplingParams.greedy(8, n=3), use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [single.token_ids] * 3
    assert no_cache.engine.scheduler.stats.num_prompt_tokens == 3 * 26


def test_seeded_choice_i_is_the_request_with_seed_plus_i(tiny_llama_dir: Path) -> None:
    llm = make(tiny_llama_dir)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=11, n=4, stop_token_ids=[7])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    alone = [llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=8, seed=11 + i, stop_token_ids=[7]),
                          use_tqdm=False)[0].outputs[0] for i in range(4)]
    assert [(o.token_ids, o.finish_reason) for o in out.outputs] == [(a.token_ids, a.finish_reason) for a in alone]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 4  # 8 random tokens of 256: never all equal
    assert params.n == 4 and params.seed == 11  # (the caller's parameters are not changed)
    unseeded = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=8, n=3), use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in unseeded.outputs}) == 3


def test_child_seeds_wrap_within_the_seed_range() -> None:
    top = (1 << 64) - 1
    assert child_params(SamplingParams(seed=top, n=3), 2).seed == 1
    assert child_params(SamplingParams(seed=5, n=3), 2).seed == 7 and child_params(SamplingParams(n=3), 2).seed is None
    assert child_params(SamplingParams(seed=5, n=3), 1).n == 1


def test_choices_under_preemption_are_unchanged(tiny_llama_dir: Path) -> None:
    """16 blocks cannot hold four 26 + 24-token sequences at once: some are preempted and recomputed."""
    want = make(tiny_llama_dir).generate([PROMPT], SamplingParams.greedy(24), use_tqdm=False)[0].token_ids
    llm = make(tiny_llama_dir, num_blocks=16, max_model_len=64)
    out = llm.generate([PROMPT], SamplingParams.greedy(24, n=4), use_tqdm=False)[0]
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert [o.token_ids for o in out.outputs] == [want] * 4
    assert llm.engine.stats().kv_usage == 0.0
    llm.engine.kv.check_integrity()


def test_an_abort_stops_every_sequence_and_frees_their_blocks(tiny_llama_dir: Path) -> None:
    eng = make(tiny_llama_dir).engine
    eng.add_request(PROMPT, SamplingParams.greedy(20, n=3), request_id="x")
    eng.step()
    eng.step()
    assert eng.stats().num_running == 3 and eng.stats().kv_usage > 0
    with pytest.raises(ValueError, match=r"^request_id: '1_x' is already in use"):
        eng.add_request(PROMPT, SamplingParams.greedy(4), request_id=child_id("x", 1))
    with pytest.raises(ValueError, match=r"^request_id: 'x' is already in use"):
        eng.add_request(PROMPT, SamplingParams.greedy(4), request_id="x")
    out = eng.abort_request("x")
    assert out is not None and out.finished and out.request_id == "x"
    assert [(o.index, o.finish_reason, len(o.token_ids)) for o in out.outputs] == [(i, "abort", 2) for i in range(3)]
    assert eng.stats().num_running == 0 and eng.stats().kv_usage == 0.0 and not eng.has_unfinished_requests()
    eng.kv.check_integrity()
    assert eng.abort_request("x") is None
    eng.add_request(PROMPT, SamplingParams.greedy(2, n=2), request_id="x")  # the id is free again
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["x"] and len(outs[-1].outputs) == 2


def test_a_sequence_aborted_alone_finishes_the_request_with_the_others(tiny_llama_dir: Path) -> None:
    eng = make(tiny_llama_dir).engine
    eng.add_request(PROMPT, SamplingParams.greedy(3, n=2), request_id="y")
    out = eng.abort_request(child_id("y", 0))
    assert out is not None and not out.finished and [o.finish_reason for o in out.outputs] == ["abort"]
    assert out.metrics is not None and out.metrics.finished_time is None  # (the request is not finished)
    aborted_at = time.time()
    last = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            last = o
    assert last is not None and last.finished and [o.finish_reason for o in last.outputs] == ["abort", "length"]
    # The request's timings: its first token is the second choice's (the first had none), it ends with it.
    m = last.metrics
    assert m is not None and m.first_token_time is not None and m.finished_time is not None
    assert aborted_at <= m.first_token_time <= m.finished_time
    assert eng.stats().kv_usage == 0.0 and not eng._parents and not eng._parent_of


@pytest.mark.parametrize("n", [0, 129, 2.0, True, "2"])
def test_bad_n_names_the_field(n: object) -> None:
    with pytest.raises(ValueError, match=r"^n: must be an int in \[1, 128\]"):
        SamplingParams(n=n)  # type: ignore[arg-type]
