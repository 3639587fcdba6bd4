"""Pinned prefixes and eviction policies in the engine (tiny Llama): `LLM.pin_prefix` / `unpin`, and
outputs that do not depend on the policy."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from helpers import fail_first_step

from kvpool.core.eviction import policy_names
from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams

SYSTEM = list(range(10, 30))  # 20 tokens: 5 full blocks of 4


def toks(seed: int, n: int) -> list[int]:
    """Distinct prompts within the tiny model's 256-token vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(40, 256) for _ in range(n)]


class Clock:
    """The `time` module with `monotonic()` reading `now`."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def make(model: Path, **kw: object) -> LLM:
    # (max_model_len: a request as long as the pool would leave no room for pins.)
    return LLM(str(model), dtype="float32", skip_tokenizer_init=True, num_blocks=40, block_size=4,
               **{"max_model_len": 64, **kw})  # type: ignore[arg-type]


def cached_ids(llm: LLM, pin) -> list[int]:
    pool = llm.engine.kv.block_pool
    return [pool.get_cached_block(h).block_id for h in pin.hashes]


def test_pin_survives_pressure_then_expires_and_refuses_over_budget(tiny_llama_dir: Path) -> None:
    llm = make(tiny_llama_dir, pin_budget=0.2)  # 39 usable blocks: 7 may be pinned
    pin = llm.pin_prefix(SYSTEM, ttl=3600)  # not cached yet: computed, then pinned
    assert pin.num_tokens == 20 and len(pin.block_ids) == 5
    ids = pin.block_ids
    greedy = SamplingParams.greedy(8)
    for i in range(12):  # each fills ~8 blocks: the pool turns over a few times
        llm.generate([toks(i, 24)], greedy, use_tqdm=False)
    assert cached_ids(llm, pin) == ids and all(llm.engine.kv.block_pool.blocks[i].ref_cnt == 1 for i in ids)
    out = llm.generate([[*SYSTEM, 1, 2]], greedy, use_tqdm=False)[0]
    assert out.num_cached_tokens == 20
    llm.engine.kv.check_integrity()
    with pytest.raises(ValueError, match=r"pin_prefix: 3 more blocks would exceed the pin budget of 7 blocks "
                                         r"\(5 pinned, 2 left\)"):
        llm.pin_prefix(toks(99, 12))  # 3 blocks: refused before computing anything
    assert llm.engine.pins.num_pinned_blocks == 5
    # A different salt shares nothing with the pinned prefix.
    assert llm.generate([[*SYSTEM, 1, 2]], greedy, use_tqdm=False, cache_salt="t2")[0].num_cached_tokens == 0
    assert llm.unpin(pin) and not llm.unpin(pin)
    for i in range(12):
        llm.generate([toks(1000 + i, 24)], greedy, use_tqdm=False)
    assert all(llm.engine.kv.block_pool.get_cached_block(h) is None for h in pin.hashes)
    llm.engine.kv.check_integrity()


def test_outputs_do_not_depend_on_the_eviction_policy(tiny_llama_dir: Path) -> None:
    prompts = [[*SYSTEM, *toks(i, 8)] for i in range(6)] + [toks(50, 30)]
    params = SamplingParams.greedy(6)
    want = None
    for policy in policy_names():  # every registered policy, on the device and the host tier
        llm = make(tiny_llama_dir, eviction_policy=policy, num_host_blocks=8, host_eviction=policy)
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        got += [o.token_ids for o in llm.generate(prompts[::-1], params, use_tqdm=False)]
        want = want or got
        assert got == want, policy


def test_ttls_that_are_not_a_duration_and_pins_of_another_engine(tiny_llama_dir: Path) -> None:
    a, b = make(tiny_llama_dir), make(tiny_llama_dir)
    for ttl in (float("nan"), 0, -1, "10", True):
        with pytest.raises(ValueError, match=r"^ttl: must be a number of seconds > 0"):
            a.pin_prefix(toks(1, 8), ttl=ttl)  # type: ignore[arg-type]
    forever = a.pin_prefix(toks(1, 8), ttl=float("inf"))
    assert forever.expires_at is None
    # Pin ids name one engine's pins: b's first pin is not a's (nor is its id), and does not unpin a's.
    theirs = b.pin_prefix(toks(2, 8))
    assert theirs.pin_id != forever.pin_id and theirs.pin_id.endswith("-1") and forever.pin_id.endswith("-1")
    assert a.unpin(theirs) is False and a.unpin(theirs.pin_id) is False and a.engine.pins.num_pinned_blocks == 2
    assert a.unpin(forever) is True and a.engine.pins.num_pinned_blocks == 0
    with pytest.raises(TypeError, match=r"^pin: expected a Pin or a pin id"):
        a.unpin(None)  # type: ignore[arg-type]


# A template that puts the system prompt inside the first user turn, as Gemma's does: the system message
# rendered alone is then not a prefix of any chat, and only what chats share can be pinned.
SYSTEM_IN_FIRST_TURN = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.sys = m['content'] + '\n\n' %}{% else %}<turn>{{ m['role'] }}\n{{ ns.sys }}{{ m['content'] }}</turn>\n"
    "{% set ns.sys = '' %}{% endif %}{% endfor %}{% if add_generation_prompt %}<turn>model\n{% endif %}")
SYSTEM_PROMPT = "You are a careful assistant who answers in one short sentence. " * 3


@pytest.mark.parametrize("template", ["own", "system in the first turn"])
def test_a_system_prompt_is_pinned_as_what_every_chat_with_it_shares(chat_llama_dir: Path, template: str) -> None:
    llm = LLM(str(chat_llama_dir), dtype="float32", num_blocks=64, max_model_len=256)
    eng = llm.engine
    if template != "own":
        eng.tokenizer.chat_template = SYSTEM_IN_FIRST_TURN
    system = [{"role": "system", "content": SYSTEM_PROMPT}]
    chats = [[*system, {"role": "user", "content": q}] for q in ("Hi!", "What is a KV cache?")]
    full = [eng.apply_chat_template(c) for c in chats]
    prefix = eng.chat_prefix(system)
    for ids in full:
        assert ids[:len(prefix)] == prefix
    assert full[0][len(prefix)] != full[1][len(prefix)]  # the longest prefix they share
    alone = eng.apply_chat_template(system, add_generation_prompt=False)
    if template == "own":
        assert full[0][:len(alone)] == alone
    else:  # why the system message rendered alone won't do: here it holds not one block of the prompt
        assert len(alone) < 16 and len(prefix) >= 32
    # Messages that end with a user's turn (a few-shot example) go on with the answer, not a second user turn.
    shot = [*system, {"role": "user", "content": "2+2?"}]
    longer = eng.chat_prefix(shot)
    conv = eng.apply_chat_template([*shot, {"role": "assistant", "content": "4."}, {"role": "user", "content": "3+3?"}])
    assert conv[:len(longer)] == longer and longer[:len(prefix)] == prefix and len(longer) > len(prefix)
    pin = llm.pin_prefix(messages=system)
    assert pin.num_tokens == len(prefix) // 16 * 16 >= 32
    outs = llm.chat(chats, SamplingParams.greedy(2), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [pin.num_tokens] * 2
    for bad in ({}, {"prompt": "x", "messages": system}):
        with pytest.raises(ValueError, match=r"^prompt: give the prefix as `prompt` or as `messages`"):
            llm.pin_prefix(**bad)


@pytest.mark.parametrize("fault", [RuntimeError("kernel exploded"), KeyboardInterrupt()])
def test_pins_are_computed_again_after_a_failed_step_but_not_after_ctrl_c(tiny_llama_dir: Path,
                                                                          fault: BaseException,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make(tiny_llama_dir, pin_budget=0.3)
    eng = llm.engine
    # The engine's clock, under the test's hand: pinned at 0 until 3814.959660635, pinned again at a time
    # where `now + (expires_at - now)` does not round back to it (as it happened on a GPU host).
    clock = Clock(0.0)
    monkeypatch.setattr("kvpool.engine.engine.time", clock)
    pin = llm.pin_prefix(SYSTEM, ttl=3814.959660635)
    clock.now = 1544.807399587359
    assert clock.now + (pin.expires_at - clock.now) != pin.expires_at
    greedy = SamplingParams.greedy(4)
    want = llm.generate([[*SYSTEM, 7, 8]], greedy, use_tqdm=False)[0].token_ids
    calls = fail_first_step(eng, fault)
    with pytest.raises(type(fault)):
        llm.generate([toks(3, 24)], greedy, use_tqdm=False)
    eng.kv.check_integrity()
    if isinstance(fault, KeyboardInterrupt):  # the user stopped it: nothing more is computed
        assert eng.pins.pins == {} and calls["steps"] == 1
        return
    # Computed again (one more step) and pinned under the same id, until the same expiry.
    again = eng.pins.pins[pin.pin_id]
    assert calls["steps"] == 2 and again.expires_at == pin.expires_at and len(again.blocks) == 5
    out = llm.generate([[*SYSTEM, 7, 8]], greedy, use_tqdm=False)[0]
    assert out.num_cached_tokens == 20 and out.token_ids == want
    assert llm.unpin(pin) is True and eng.pins.pins == {}  # the caller's Pin still names it


def test_ctrl_c_while_pins_are_computed_again_leaves_a_clean_engine(tiny_llama_dir: Path) -> None:
    llm = make(tiny_llama_dir, pin_budget=0.3)
    eng = llm.engine
    pin = llm.pin_prefix(SYSTEM)
    calls = fail_first_step(eng, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.reset_prefix_cache()  # its one step, computing the pin again, is interrupted
    assert calls["steps"] == 1 and not eng.has_unfinished_requests() and eng.pins.pins == {}
    assert not eng.kv.block_pool.cached  # the half-computed blocks were forgotten
    eng.kv.check_integrity()
    assert llm.reset_prefix_cache() is True  # the next reset makes the pin it could not
    assert list(eng.pins.pins) == [pin.pin_id] and calls["steps"] == 2
    greedy = SamplingParams.greedy(4)
    assert llm.generate([[*SYSTEM, 7, 8]], greedy, use_tqdm=False)[0].num_cached_tokens == 20


def test_pins_computed_again_are_not_counted_as_traffic(tiny_llama_dir: Path) -> None:
    """A reset computes the pinned prefixes again: the engine's own steps, which the prefix-cache and token
    counters (what `/metrics` and a user's hit rate are made of) leave out."""
    llm = make(tiny_llama_dir, pin_budget=0.3)
    eng = llm.engine
    pin = llm.pin_prefix(SYSTEM)
    assert llm.generate([[*SYSTEM, 7, 8]], SamplingParams.greedy(4), use_tqdm=False)[0].num_cached_tokens == 20
    stats = eng.stats()
    totals = (eng.kv.stats.requests, eng.kv.stats.queries, eng.kv.stats.hits)
    eng.take_prefix_cache_stats()
    assert llm.reset_prefix_cache() is True  # one step computes SYSTEM again and pins it
    assert len(cached_ids(llm, pin)) == 5 and list(eng.pins.pins) == [pin.pin_id]
    assert (eng.kv.stats.requests, eng.kv.stats.queries, eng.kv.stats.hits) == totals
    assert eng.take_prefix_cache_stats().queries == 0
    assert eng.stats().num_generation_tokens == stats.num_generation_tokens
    # Traffic after it counts as before: 22 tokens looked up, the pinned 20 found.
    assert llm.generate([[*SYSTEM, 9, 9]], SamplingParams.greedy(4), use_tqdm=False)[0].num_cached_tokens == 20
    pc = eng.take_prefix_cache_stats()
    assert (pc.requests, pc.queries, pc.hits) == (1, 22, 20)
    assert eng.stats().num_generation_tokens == stats.num_generation_tokens + 4


def test_the_longest_request_fits_beside_a_full_pin_budget(tiny_llama_dir: Path) -> None:
    """Pinned blocks are never preempted: the pin budget never takes the room the longest request the engine
    accepts needs, or a pin would leave that request waiting forever (and every request queued behind it).
    39 usable blocks of 4 tokens, half of them (19) for pins."""
    def engine(**kw: object) -> LLM:
        return LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=40, block_size=4,
                   pin_budget=0.5, **kw)

    # The pool is the limit: a 156-token request holds all 39 blocks, and leaves no room to pin.
    llm = engine()
    assert llm.engine.max_model_len == 39 * 4 and llm.engine.pins.budget_blocks == 0
    with pytest.raises(ValueError, match=r"exceed the pin budget of 0 blocks"):
        llm.pin_prefix(SYSTEM)
    # An 80-token max_model_len holds 20 blocks: the pins get the other 19, the whole budget.
    llm = engine(max_model_len=80)
    assert llm.engine.pins.budget_blocks == 19
    pin = llm.pin_prefix(toks(7, 19 * 4))
    assert len(pin.block_ids) == 19
    out = llm.generate([toks(8, 80 - 6), toks(9, 10)], SamplingParams.greedy(6), use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [6, 6]  # the longest request ran beside them
    llm.engine.kv.check_integrity()
    # 100 tokens hold 25 blocks: 14 are left for pins.
    assert engine(max_model_len=100).engine.pins.budget_blocks == 14
