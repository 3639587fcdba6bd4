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

# Compiled constraints kept for the next request with the same one. Each holds its lexer's states (up to
# MAX_LEXER_STATES of ~1-2 kB, and its tables: a pathological regex's held 165 MB at 50k states), so a few.
MAX_COMPILED = 8
# llguidance's own bounds, tighter than its defaults (250k lexer states) so that one request's regex cannot hold
# hundreds of MB: past them the constraint is refused (a 400), never run half-built.
MAX_LEXER_STATES = 20_000

# JSON Schema keywords whose values are schemas (`_no_additional_properties` walks these only: `const`, `enum`,
# `default` and `examples` hold JSON values, which must not be rewritten).
_SCHEMA_KEYS = {"items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                "additionalProperties", "unevaluatedProperties", "unevaluatedItems"}
_SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems", "items"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def _no_additional_properties(schema: Any) -> Any:
    """A copy of a JSON schema whose objects that do not say otherwise take no properties beyond theirs (vLLM's
    disable_additional_properties). Only the keywords that hold schemas are walked."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _no_additional_properties(sub) for name, sub in v.items()}
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            out[k] = [_no_additional_properties(sub) for sub in v]
        elif k in _SCHEMA_KEYS and isinstance(v, dict):
            out[k] = _no_additional_properties(v)
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
        if schema is True:  # (JSON Schema's `true`: any value, as the empty schema)
            schema = {}
        if schema is False:
            raise ValueError("structured_outputs.json: the schema false admits no value")
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json: a JSON schema is an object, got {type(schema).__name__}")
        if params.disable_additional_properties:
            schema = _no_additional_properties(schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": not params.disable_any_whitespace})
        except (ValueError, TypeError) as e:  # (a schema the compiler cannot read: a 400 naming the field)
            raise ValueError(f"structured_outputs.{kind}: {_one_line(str(e))}") from None
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)  # type: ignore[arg-type]
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


# llguidance's names for why a matcher stopped, where they stand for the whole error.
_STOP_REASONS = {"NoExtensionBias": "no text satisfies it (nothing may come next, and nothing so far is complete)",
                 "NoExtension": "no text satisfies it (nothing may come next, and nothing so far is complete)"}


def _one_line(err: str) -> str:
    """llguidance's error, which quotes the grammar it built around the user's (a regex inside a Lark rule),
    as one line: its first (less the position in that grammar) and the lines that say what is wrong."""
    lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip()]
    if not lines:
        return "invalid"
    first = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    first = _STOP_REASONS.get(first, first)
    return " ".join([first, *(ln for ln in lines[1:] if ln.startswith("error:"))])[:500]


class Grammar:
    """One sequence's constraint: the tokens it may take next, advanced by each token it takes."""

    def __init__(self, matcher: Any, num_logits: int, eos_token_ids: Sequence[int], first: bytes) -> None:
        self.matcher = matcher
        self.num_logits = num_logits
        self.eos_token_ids = [t for t in eos_token_ids if t < num_logits]
        self._first: bytes | None = first  # (the first step's mask, computed when the constraint was compiled)

    def accept(self, token: int) -> None:
        """The sequence took `token`. Past the constraint's end (only EOS was allowed, and EOS did not end it:
        ignore_eos, or min_tokens) nothing changes: the mask stays EOS."""
        m = self.matcher
        self._first = None
        if not m.is_stopped():
            m.consume_token(token)

    def mask(self) -> torch.Tensor:
        """The tokens it may take next (bool, over the LM head's width). A matcher in error (one of llguidance's
        bounds reached mid-way; the stop checker ends such a request) allows EOS alone."""
        if self.matcher.is_error():
            allowed = torch.zeros(self.num_logits, dtype=torch.bool)
            allowed[self.eos_token_ids] = True
            return allowed
        bits = self._first if self._first is not None else self.matcher.compute_bitmask()
        return _unpack(bits, self.num_logits)

    @property
    def error(self) -> str:
        """Why the matcher stopped following the text ("" while it follows)."""
        return _one_line(self.matcher.get_error()) if self.matcher.is_error() else ""


def _unpack(bits: bytes, n: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:n].astype(bool))


class Grammars:
    """Constraints compiled against one tokenizer (built once, on the first structured request: ~0.4 s for a
    50k-token vocabulary), the matchers of the last MAX_COMPILED kept for requests that send the same one.

    Compiling runs on the caller's thread (a server's request thread, never the engine's), outside any lock
    but the one per constraint: requests sending the same new constraint wait for one compile, and the others
    go on. The first step's mask is computed then too (llguidance builds a regex's lexer lazily, on the first
    mask: a slow one would stall every running sequence on the engine's thread), and a constraint llguidance
    refuses there (one of its bounds) is a ValueError naming the field, before the request exists."""

    def __init__(self, tokenizer: Any, num_logits: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.num_logits = num_logits
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[str, tuple[Any, bytes]] = OrderedDict()
        self._lock = threading.Lock()  # the dict and the tokenizer
        self._compiling: dict[str, threading.Lock] = {}  # a lock per constraint being compiled

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                # (a tokenizer may be longer than the LM head: Mllama's image token lies past it; the mask is
                # cut to the head's width)
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=max(self.num_logits, len(self.tokenizer)),
                    eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh constraint for one sequence; ValueError naming the field for one that does not compile."""
        spec = grammar_spec(params)
        compiled = self._cached(spec)
        if compiled is None:
            with self._lock:
                gate = self._compiling.setdefault(spec, threading.Lock())
            with gate:  # (the same constraint sent twice at once: compiled once)
                compiled = self._cached(spec)
                if compiled is None:
                    try:
                        compiled = self._compile(spec, params.kind)
                        with self._lock:  # (cached before its gate goes: a request in between finds it)
                            self._compiled[spec] = compiled
                            if len(self._compiled) > MAX_COMPILED:
                                self._compiled.popitem(last=False)
                    finally:
                        with self._lock:
                            self._compiling.pop(spec, None)
        matcher, first = compiled
        return Grammar(matcher.deep_copy(), self.num_logits, self.eos_token_ids, first)

    def compiled(self, params: StructuredOutputsParams) -> bool:
        """Whether `params`' constraint is compiled already (False for one that would not compile)."""
        try:
            spec = grammar_spec(params)
        except ValueError:
            return False
        with self._lock:
            return spec in self._compiled

    def _cached(self, spec: str) -> tuple[Any, bytes] | None:
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
            return compiled

    def _compile(self, spec: str, kind: str) -> tuple[Any, bytes]:
        import llguidance

        limits = llguidance.LLParserLimits(max_lexer_states=MAX_LEXER_STATES)
        matcher = llguidance.LLMatcher(self._tokenizer(), spec, log_level=0, limits=limits)
        first = b"" if matcher.is_error() else matcher.compute_bitmask()
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind}: {_one_line(matcher.get_error())}")
        return matcher, first
