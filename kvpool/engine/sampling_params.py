"""Sampling parameters of a request, validated up front: a bad value is a ValueError naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# n: sequences sampled from one prompt at most (OpenAI's bound). Each is a request of its own in the scheduler,
# sharing the prompt's blocks (kvpool.engine.parallel_sampling).
MAX_N = 128
MAX_LOGIT_BIAS = 1024  # tokens one request may bias (every step adds them to its logits)
MAX_ALLOWED_TOKENS = 1 << 17  # tokens one request may restrict its sampling to (more than any vocabulary)
# bad_words: every step of the request matches each word's tokens against its output's tail, so they are bounded
# (vLLM's bounds): words, their token sequences (a word may give two: as written, and after a space) and tokens.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_SEQUENCES = 128
MAX_BAD_WORD_TOKENS = 1024
MAX_LOGPROBS = 20  # top tokens' log-probabilities per sampled token at most (OpenAI's and vLLM's default bound)


MAX_CHOICES = 1024  # strings one structured_outputs.choice may hold


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: the text generated is constrained to one of these (kvpool.engine.structured).
    Exactly one of `json` (a JSON schema, as a dict or its text), `regex`, `choice` (the answer is one of
    these strings), `grammar` (Lark, or llama.cpp's GBNF) or `json_object` (any JSON object)."""

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON only: no whitespace between its tokens (default: any, as vLLM's), and objects without
    # additionalProperties in the schema take none (default: JSON Schema's, any).
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        self.validate()

    def _given(self) -> list[str]:
        # (json_object false asks for nothing; a json schema of `false` is a schema, refused when compiled)
        return [k for k in self.KINDS if getattr(self, k) is not None and (k != "json_object" or self.json_object)]

    @property
    def kind(self) -> str:
        """Which constraint it is (the one field of KINDS set)."""
        return self._given()[0]

    def validate(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(self.KINDS)} must be set, got "
                             f"{given or 'none'}")
        if self.json is not None and not isinstance(self.json, str | dict | bool):
            raise ValueError(f"structured_outputs.json: a JSON schema (an object or its text), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name}: a non-empty string, got {v!r:.40}")
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, list | tuple) or not c or not all(isinstance(x, str) for x in c):
                raise ValueError(f"structured_outputs.choice: a non-empty list of strings, got {c!r:.60}")
            if len(c) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice: at most {MAX_CHOICES} strings, got {len(c)}")
            self.choice = list(c)
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"structured_outputs.{name}: must be true or false, got {v!r:.40}")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM spells it): no top-k
    max_tokens: int | None = 16  # None: until the context is full
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    include_stop_str_in_output: bool = False
    # Each sampled token's log-probability and this many most likely tokens' (0: the sampled one's alone;
    # None: none), under the model's own distribution (kvpool.runner.sampler.TokenLogprobs).
    logprobs: int | None = None
    # Each prompt token's log-probability (but the first's: nothing precedes it) and this many most likely
    # tokens' at its position (RequestOutput.prompt_logprobs), as vLLM's prompt_logprobs. A cached block holds
    # keys and values, not logits: the request's prefix hit is limited to the blocks whose rows the prompt-row
    # cache holds (kvpool.runner.prompt_rows; none without it: the prompt computed whole, as vLLM's).
    prompt_logprobs: int | None = None
    # vLLM's penalties, applied to the logits before anything else (greedy rows too): presence and frequency
    # over the tokens generated so far (each distinct one once, each occurrence once), repetition (> 1
    # discourages, < 1 encourages) over the prompt's and the generated tokens, as transformers' processor.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Tokens whose probability is below min_p times the most likely one's are not drawn (after temperature).
    min_p: float = 0.0
    # No stop token (EOS, stop_token_ids) is drawn, and no stop string ends the answer, before this many
    # tokens (vLLM's min_tokens).
    min_tokens: int = 0
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit (greedy requests too).
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these tokens may be drawn (greedy requests too; logprobs stay the model's own distribution).
    allowed_token_ids: list[int] | None = None
    # vLLM's: keep only the prompt's last this many tokens (-1: as many as the context holds, less one to generate).
    truncate_prompt_tokens: int | None = None
    # vLLM's: words never generated. Each is tokenized as it stands and after a space (the same word inside a
    # text); a token that would complete one of those token sequences after the output's last tokens is not drawn.
    bad_words: list[str] | None = None
    # vLLM's: special tokens (a chat template's markers) left out of the text (the token ids keep them).
    skip_special_tokens: bool = True
    # vLLM's: False joins consecutive special tokens' text without the space a tokenizer may put between them.
    spaces_between_special_tokens: bool = True
    # vLLM's: the text constrained to a JSON schema, a regex, a choice or a grammar (StructuredOutputsParams).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (and bring `stop` to a list); the engine calls it again at each request,
        since a field may be changed after construction."""
        if self.stop is None or isinstance(self.stop, str):
            self.stop = [self.stop] if self.stop else []
        elif isinstance(self.stop, list | tuple):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop: a string or a list of strings, got {type(self.stop).__name__}")
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"stop_token_ids: a list of token ids, got {type(self.stop_token_ids).__name__}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be True or False, got {getattr(self, name)!r}")

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{name}: must be a finite number, got {v!r}")
            return float(v)

        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name) <= 2:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= number("min_p") <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias: a map of token ids to biases, got {type(self.logit_bias).__name__}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:  # (each step adds them to the request's logits)
                raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"logit_bias: keys are token ids (ints >= 0), got {t!r}")
                if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias: {t}: a bias in [-100, 100], got {b!r}")
        if self.allowed_token_ids is not None:
            a = self.allowed_token_ids
            if not isinstance(a, list | tuple) or not a:
                raise ValueError(f"allowed_token_ids: a non-empty list of token ids, got {a!r:.60}")
            if len(a) > MAX_ALLOWED_TOKENS:
                raise ValueError(f"allowed_token_ids: at most {MAX_ALLOWED_TOKENS} tokens, got {len(a)}")
            if not all(type(t) is int and t >= 0 for t in a):
                raise ValueError("allowed_token_ids: every entry must be a token id (an int >= 0)")
        if self.bad_words is not None:
            w = self.bad_words
            if not isinstance(w, list | tuple):
                raise ValueError(f"bad_words: a list of strings, got {type(w).__name__}")
            if len(w) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(w)}")
            if not all(isinstance(x, str) and x.strip() for x in w):
                raise ValueError("bad_words: every entry must be a string with something besides spaces")
            self.bad_words = list(w)
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise ValueError(f"structured_outputs: a StructuredOutputsParams, got {type(so).__name__}")
            so.validate()
        t = self.truncate_prompt_tokens
        if t is not None and (type(t) is not int or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens: an int >= 1, or -1 (the context's length), got {t!r}")
        if number("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty: must be > 0 (1: off), got {self.repetition_penalty}")
        if number("temperature") < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k: must be an int >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0  # vLLM's "off" (clients written for it send -1)
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool)
                                            or not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens: must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if type(self.n) is not int or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be an int in [1, {MAX_N}] (sequences sampled from the prompt), got {self.n!r}")
        if self.logprobs is not None and (type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: must be an int in [0, {MAX_LOGPROBS}] (the top tokens to return), got "
                             f"{self.logprobs!r}")
        if self.prompt_logprobs is not None and (type(self.prompt_logprobs) is not int
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs: must be an int in [0, {MAX_LOGPROBS}] (the top tokens to return), "
                             f"got {self.prompt_logprobs!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(1 << 63) <= self.seed < 1 << 64):
            # (torch's generators take 64-bit seeds: a larger one would fail on the engine thread)
            raise ValueError(f"seed: must be an int in [-2**63, 2**64), got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):  # type: ignore[union-attr]
            raise ValueError("stop: every stop string must be a non-empty string")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: every stop token id must be an int >= 0")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (each needs the request's tokens so far)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @classmethod
    def greedy(cls, max_tokens: int | None = 16, **kw: object) -> SamplingParams:
        return cls(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
