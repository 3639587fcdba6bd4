"""Structured outputs: a request's text held to a JSON schema, a regex, a choice of strings or a grammar, as
vLLM's `structured_outputs` (and OpenAI's `response_format`) ask, by masking the tokens that would leave it.

The grammar work is llguidance's (the library vLLM's "guidance" backend uses): it compiles the constraint
against the model's tokenizer and, at each step, gives the set of tokens that keep the text a prefix of
something the constraint accepts (EOS only where the text is complete). kvpool keeps one matcher per sequence,
advances it by each token the sequence gets (`Grammar.accept`), and hands the sampler the mask of the next
token (`Grammar.mask`): the tokens outside it get -inf, greedy rows too. The KV cache knows nothing of it: a
grammar constrains which token comes next, never what a block holds, so prefix hits are unchanged.

Compiling a constraint builds a matcher; the same constraint again (a client's fixed schema) deep-copies the
one compiled before (`Grammars`, an LRU of them).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvpool.engine.sampling_params import StructuredOutputsParams

MAX_COMPILED = 64  # constraints whose compiled matcher is kept for the next request with the same one


def _no_additional_properties(schema: Any) -> Any:
    """A copy of a JSON schema whose objects that do not say otherwise take no properties beyond theirs (vLLM's
    disable_additional_properties)."""
    if isinstance(schema, list):
        return [_no_additional_properties(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    # (type "object" only: a `properties` map is walked too, and a property may be named "properties")
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_spec(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for a constraint (not yet checked: `Grammars.grammar` does)."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not JSON ({e})") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"structured_outputs.json: a JSON schema is an object, got {type(schema).__name__}")
        if params.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": not params.disable_any_whitespace})
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)  # type: ignore[arg-type]
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


def _one_line(err: str) -> str:
    """llguidance's error, which quotes the grammar it built around the user's (a regex inside a Lark rule),
    as one line: its first (less the position in that grammar) and the lines that say what is wrong."""
    lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip()]
    if not lines:
        return "invalid"
    first = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    return " ".join([first, *(ln for ln in lines[1:] if ln.startswith("error:"))])[:500]


class Grammar:
    """One sequence's constraint: the tokens it may take next, advanced by each token it takes."""

    def __init__(self, matcher: Any, num_logits: int, eos_token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.num_logits = num_logits
        self.eos_token_ids = [t for t in eos_token_ids if t < num_logits]

    def accept(self, token: int) -> None:
        """The sequence took `token`. Past the constraint's end (only EOS was allowed, and EOS did not end it:
        ignore_eos, or min_tokens) nothing changes: the mask stays EOS."""
        m = self.matcher
        if not m.is_stopped():
            m.consume_token(token)

    def mask(self) -> torch.Tensor:
        """The tokens it may take next (bool, over the LM head's width). A matcher in error (a token outside the
        mask was drawn: the request's allowed_token_ids left none of the constraint's) allows EOS alone: the
        text ends where it was still a prefix of what the constraint accepts."""
        if self.matcher.is_error():
            allowed = torch.zeros(self.num_logits, dtype=torch.bool)
            allowed[self.eos_token_ids] = True
            return allowed
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.num_logits].astype(bool))

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""

    @property
    def complete(self) -> bool:
        """Whether the text so far is one the constraint accepts whole."""
        return bool(self.matcher.is_accepting())


class Grammars:
    """Constraints compiled against one tokenizer (built once, on the first structured request: ~0.4 s for a
    50k-token vocabulary), the matchers of the last MAX_COMPILED kept for requests that send the same one."""

    def __init__(self, tokenizer: Any, num_logits: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.num_logits = num_logits
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # (requests are made on the server's handler threads)

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.num_logits, eos_token=self.eos_token_ids or None)
        return self._ll_tokenizer

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh constraint for one sequence; ValueError naming the field for one that does not compile."""
        import llguidance

        spec = grammar_spec(params)
        with self._lock:
            tok = self._tokenizer()
            compiled = self._compiled.get(spec)
            if compiled is None:
                err = llguidance.LLMatcher.validate_grammar(spec, tok)
                compiled = None if err else llguidance.LLMatcher(tok, spec, log_level=0)
                if compiled is None or compiled.is_error():
                    raise ValueError(f"structured_outputs.{params.kind}: "
                                     f"{_one_line(err or compiled.get_error())}")  # type: ignore[union-attr]
                self._compiled[spec] = compiled
                if len(self._compiled) > MAX_COMPILED:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(spec)
            return Grammar(compiled.deep_copy(), self.num_logits, self.eos_token_ids)
