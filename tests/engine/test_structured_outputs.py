"""Structured outputs (vLLM's structured_outputs: a JSON schema, any JSON object, a regex, a choice, a Lark
grammar) on a tiny random model wearing SmolLM2's tokenizer: whatever its weights prefer, the text is what the
constraint accepts, and greedy tokens are transformers' argmax among the tokens llguidance allows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams, StructuredOutputsParams

PROMPT = "Answer:"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["alpha", "beta"]}}}


@pytest.fixture(scope="module")
def llm(chat_llama_dir: Path) -> LLM:
    return LLM(str(chat_llama_dir), dtype="float32", num_blocks=64, block_size=4, max_model_len=128)


def run(llm: LLM, so: StructuredOutputsParams, n: int = 40, prompt: str = PROMPT, **kw: object):
    return llm.generate(prompt, SamplingParams.greedy(n, structured_outputs=so, **kw), use_tqdm=False)[0]


def test_greedy_is_the_argmax_among_the_tokens_llguidance_allows(llm: LLM, chat_llama_dir: Path) -> None:
    import llguidance
    import llguidance.hf
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    out = run(llm, so)
    assert out.outputs[0].finish_reason == "stop"
    assert json.loads(out.text)["tag"] in ("alpha", "beta") and set(json.loads(out.text)) == {"ok", "n", "tag"}
    # The reference: transformers' logits, masked by a matcher of llguidance's own, argmax, until EOS.
    tok = AutoTokenizer.from_pretrained(str(chat_llama_dir))
    model = AutoModelForCausalLM.from_pretrained(str(chat_llama_dir), dtype=torch.float32)
    ll_tok = llguidance.hf.from_tokenizer(tok, n_vocab=model.config.vocab_size, eos_token=tok.eos_token_id)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(ll_tok, grammar)
    ids, want = llm.engine.encode(PROMPT), []
    while not want or want[-1] != tok.eos_token_id:
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        logits[torch.from_numpy(bits[:logits.shape[0]] == 0)] = float("-inf")
        want.append(int(logits.argmax()))
        ids.append(want[-1])
        matcher.consume_token(want[-1])
    assert out.token_ids == want
    # Unconstrained, the same model says something else entirely.
    assert llm.generate(PROMPT, SamplingParams.greedy(len(want)), use_tqdm=False)[0].token_ids != want


@pytest.mark.parametrize(("so", "accepts"), [
    (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
     lambda t: isinstance(json.loads(t), dict)),
    (StructuredOutputsParams(choice=["yes", "no way"]), lambda t: t in ("yes", "no way")),
    (StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", t)),
    (StructuredOutputsParams(grammar='start: "x" ("," "y")*'), lambda t: re.fullmatch(r"x(,y)*", t)),
    # llama.cpp's GBNF, converted by llguidance
    (StructuredOutputsParams(grammar='root ::= "up" | "down"'), lambda t: t in ("up", "down")),
])
def test_every_kind_of_constraint_holds_the_text(llm: LLM, so: StructuredOutputsParams, accepts) -> None:
    out = run(llm, so)
    assert out.outputs[0].finish_reason == "stop" and accepts(out.text), out.text
    # Sampled, each of n sequences with a matcher of its own.
    sp = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=40, structured_outputs=so)
    for o in llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs:
        assert o.finish_reason == "stop" and accepts(o.text), o.text


def test_tokens_are_the_same_with_preemption_and_without_the_prefix_cache(chat_llama_dir: Path,
                                                                          llm: LLM) -> None:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    prompts = [PROMPT, "Reply in JSON:", "Answer:"]
    want = [run(llm, so, n=30, prompt=p).token_ids for p in prompts]
    # A pool too small for three at once: preempted sequences resume with their matchers where they were.
    small = LLM(str(chat_llama_dir), dtype="float32", num_blocks=12, block_size=4, max_model_len=40,
                enable_prefix_caching=False)
    outs = small.generate(prompts, SamplingParams.greedy(30, structured_outputs=so), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert small.engine.scheduler.stats.num_preemptions > 0


def test_the_end_of_the_constraint_allows_eos_alone(llm: LLM) -> None:
    eos = llm.engine.tokenizer.eos_token_id
    # ignore_eos: EOS does not end it, and the matcher, past its end, keeps allowing EOS alone.
    out = run(llm, StructuredOutputsParams(choice=["yes"]), n=5, ignore_eos=True)
    assert out.token_ids[-4:] == [eos] * 4 and out.text == "yes" and out.outputs[0].finish_reason == "length"
    # allowed_token_ids that leave none of the constraint's tokens: the constraint wins where they do.
    yes = llm.engine.encode("yes", add_special_tokens=False)
    out = run(llm, StructuredOutputsParams(choice=["yes"]), allowed_token_ids=[yes[0] + 1, eos])
    assert out.token_ids == [*yes, eos] and out.text == "yes"
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=5, allowed_token_ids=[yes[0] + 1],
                             structured_outputs=StructuredOutputsParams(choice=["yes"]))
    assert llm.generate(PROMPT, sampled, use_tqdm=False)[0].token_ids == [*yes, eos]


def test_no_penalty_or_ban_lifts_the_constraint(llm: LLM) -> None:
    # (a repetition penalty once turned the mask's -inf into the lowest float: tokens outside it were drawn
    # wherever the bans and allowed_token_ids then left nothing else)
    yes = llm.engine.encode("yes", add_special_tokens=False)
    so = StructuredOutputsParams(choice=["yes"])
    for kw in (dict(min_tokens=4), dict(bad_words=["yes"]), dict(allowed_token_ids=[yes[0] + 1])):
        out = run(llm, so, n=6, repetition_penalty=1.1, frequency_penalty=0.5, **kw)  # type: ignore[arg-type]
        assert out.token_ids[:len(yes)] == yes and out.text == "yes", (kw, out.text)


def test_llguidance_bounds_refuse_or_end_the_text_saying_why(llm: LLM) -> None:
    # A schema no text satisfies: refused when the request is made (its first mask is computed then).
    with pytest.raises(ValueError, match=r"structured_outputs\.json: no text satisfies it"):
        run(llm, StructuredOutputsParams(json={"$ref": "#"}))
    with pytest.raises(ValueError, match=r"structured_outputs\.json: the schema false admits no value"):
        run(llm, StructuredOutputsParams(json=False))  # type: ignore[arg-type]
    # JSON Schema's `true`: any JSON value, as the empty schema.
    anything = run(llm, StructuredOutputsParams(json={}, disable_any_whitespace=True), n=8).token_ids
    assert run(llm, StructuredOutputsParams(json=True, disable_any_whitespace=True), n=8).token_ids == anything
    # A grammar past a bound of llguidance's only once the text has begun (a row of 3001 items): the text ends
    # where the matcher stopped following it, and stop_reason says why (not a silent "stop").
    wide = StructuredOutputsParams(grammar="start: " + " | ".join(f'"k{i}" /[a-z]+/' for i in range(3000)))
    out = run(llm, wide).outputs[0]
    assert out.finish_reason == "stop" and out.text.startswith("k")
    assert str(out.stop_reason).startswith("structured_outputs: Parser Error: Current row has 3001 items")
    assert not llm.engine.has_unfinished_requests()


def test_a_tokenizer_longer_than_the_lm_head(chat_mllama_dir: Path) -> None:
    # Mllama's image token lies past its LM head: llguidance sees the whole tokenizer, the mask the head's width.
    mllama = LLM(str(chat_mllama_dir), dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    assert len(mllama.engine.tokenizer) > mllama.engine.runner.num_logits
    out = run(mllama, StructuredOutputsParams(regex="[a-c]{2,4}-[0-9]{2}"))
    assert out.outputs[0].finish_reason == "stop" and re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", out.text)


def test_a_matcher_in_error_allows_eos_alone(llm: LLM) -> None:
    # (a token outside the mask cannot be drawn; were one taken, the text ends there rather than going on
    # unconstrained)
    grammar = llm.engine.grammars.grammar(StructuredOutputsParams(choice=["yes"]))
    assert grammar.mask().sum() >= 1 and not grammar.mask()[llm.engine.eos_token_ids].any()
    grammar.accept(llm.engine.encode("no", add_special_tokens=False)[0])
    assert grammar.error and grammar.mask().nonzero().flatten().tolist() == sorted(llm.engine.eos_token_ids)


def test_bad_constraints_are_refused_naming_the_field(llm: LLM, tiny_llama_dir: Path) -> None:
    cases = [
        (dict(regex="[a-"), r"structured_outputs.regex: .*unclosed character class"),
        (dict(json={"type": "integer", "minimum": "x"}), "structured_outputs.json: "),
        (dict(json="{not json"), "structured_outputs.json: not JSON"),
        (dict(grammar="start: ( "), "structured_outputs.grammar: "),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            run(llm, StructuredOutputsParams(**kw))  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()
    for kw, msg in [(dict(), "exactly one of json, regex, choice, grammar, json_object must be set, got none"),
                    (dict(regex="a", choice=["a"]), r"exactly one .* got \['regex', 'choice'\]"),
                    (dict(choice=[]), "structured_outputs.choice: a non-empty list of strings"),
                    (dict(choice=["a", 1]), "structured_outputs.choice: a non-empty list of strings"),
                    (dict(json=5), "structured_outputs.json: a JSON schema"),
                    (dict(json_object=True, disable_any_whitespace="no"),
                     "structured_outputs.disable_any_whitespace: must be true or false")]:
        with pytest.raises(ValueError, match=msg):
            StructuredOutputsParams(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structured_outputs: a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    bare = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="structured_outputs: need the tokenizer"):
        bare.generate([[5, 6]], SamplingParams.greedy(2, structured_outputs=StructuredOutputsParams(regex="a")),
                      use_tqdm=False)


def test_additional_properties_can_be_disabled(llm: LLM) -> None:
    # A schema silent on additionalProperties takes any (JSON Schema's rule); vLLM's option takes none.
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    closed = run(llm, StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                              disable_additional_properties=True))
    assert set(json.loads(closed.text)) == {"a"}
    from kvpool.engine.structured import _no_additional_properties

    nested = {"type": "object", "properties": {"x": {"type": "object"}, "y": {"additionalProperties": True},
                                               "properties": {"type": "object"},  # (a property so named)
                                               "c": {"const": {"type": "object"}, "default": {"type": "object"}}},
              "anyOf": [{"type": "object"}], "$defs": {"d": {"type": "object"}}}
    assert _no_additional_properties(nested) == {
        "type": "object", "additionalProperties": False,
        "properties": {"x": {"type": "object", "additionalProperties": False}, "y": {"additionalProperties": True},
                       "properties": {"type": "object", "additionalProperties": False},
                       "c": {"const": {"type": "object"}, "default": {"type": "object"}}},  # (values, not schemas)
        "anyOf": [{"type": "object", "additionalProperties": False}],
        "$defs": {"d": {"type": "object", "additionalProperties": False}}}
