"""Request bodies of the OpenAI-compatible API, validated with pydantic, and their mapping to SamplingParams.

Fields kvpool does not implement are refused with a message naming them when they would change the
result (tools, function calls, vLLM's beam search, a completion's chat template options: `_UNSUPPORTED`), and
ignored when they are only bookkeeping (`user`, `metadata`). Structured outputs come from any one of
OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields (`_structured_outputs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvpool.engine.chat_template import ChatOptions
from kvpool.engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from kvpool.server.errors import rename_field

MAX_STOP_STRINGS = 64  # per request (OpenAI's limit is 4; vLLM's clients send more)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # (an option not known here would be ignored: refused instead)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk, not only in a last one


def _none_or(*ok: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or (not isinstance(v, bool) and v in ok)


def _none_or_flag(default: bool) -> Callable[[Any], bool]:
    return lambda v: v is None or v is default


# Fields that change the answer (its tokens or what comes back) and that kvpool does not implement:
# refused when set to anything but their no-op value, never silently ignored. Each maps to "this value
# changes nothing".
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": _none_or(1),
    "guided_whitespace_pattern": _none_or(),
    "tools": lambda v: v is None or v == [],
    "tool_choice": _none_or("none", "auto"),
    "functions": lambda v: v is None or v == [],
    "function_call": _none_or("none", "auto"),
    # vLLM's extensions that change the tokens or the text (their no-op values as vLLM defaults them).
    "use_beam_search": _none_or_flag(False),
    "length_penalty": _none_or(1),
    # ... and chat's (on /v1/completions `echo` is a field of its own).
    "echo": _none_or_flag(False),
    "add_generation_prompt": _none_or_flag(True),
    "add_special_tokens": _none_or_flag(False),  # (chat's: the template places the special tokens)
    "continue_final_message": _none_or_flag(False),
    "chat_template": _none_or(),
    "chat_template_kwargs": lambda v: v is None or v == {},
    "documents": _none_or(),
    # Chat's name for max_tokens, sent to /v1/completions, would bound nothing there.
    "max_completion_tokens": _none_or(),
}


class _NullIsDefault(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _null_means_not_sent(cls, data: Any) -> Any:
        # OpenAI's API reads an explicit null as the field's default, and clients that serialize every field
        # send `"n": null`, `"stream": null`: an optional field that takes no None takes its default instead.
        # (Where None is a value of its own, as max_tokens' "no bound", it stays.)
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].is_required()
                    or type(None) in get_args(fields[k].annotation)}
        return data


class _SamplingFields(_NullIsDefault):
    # Fields not declared are kept aside (model_extra), never used: bookkeeping (`user`, `metadata`) passes,
    # and the ones in _UNSUPPORTED are refused unless they are no-ops.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: Any = None
    # Extensions (as vLLM accepts them, in the body or via the OpenAI client's extra_body).
    top_k: int | None = None
    repetition_penalty: float | None = None  # (None: the model's generation_config value, else 1: off)
    min_p: float | None = None  # (likewise; else 0: off)
    min_tokens: int = 0  # vLLM's: no stop token or stop string before this many tokens
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids (as strings) -> [-100, 100]
    # vLLM's: each prompt token's log-probability and this many top tokens' (the response's prompt_logprobs)
    prompt_logprobs: Any = None
    # vLLM's: the prompt's token ids and each choice's (completions: in the choice; chat: prompt_token_ids at the
    # top), streamed with the chunks that bring them (the prompt's in a choice's first chunk; chat: the first of all)
    return_token_ids: bool = False
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens that may be drawn
    bad_words: list[str] | None = None  # vLLM's: words never generated
    # The text held to a JSON schema, a regex, a choice or a grammar (kvpool.engine.structured): OpenAI's
    # response_format (json_object, json_schema), vLLM's structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # (vLLM's choice of library: kvpool has one, llguidance)
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens' text in the output
    spaces_between_special_tokens: bool = True  # vLLM's
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last this many tokens (-1: what fits)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # Requests with different salts never share cached blocks: tenant isolation against timing side channels.
    cache_salt: str | None = Field(default=None, min_length=1)


    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        # Every step searches each running request's new text for each of its stop strings, on the engine
        # thread: thousands of them in one request would slow every other request (OpenAI takes 4).
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise PydanticCustomError("stop", "at most {n} stop strings, got {got}",
                                      {"n": MAX_STOP_STRINGS, "got": len(v)})
        return v

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """A ValueError naming the field for a value kvpool cannot honour. `defaults`: the model's values of
        temperature, top_p and top_k, for those the request leaves out (`LLMEngine.sampling_defaults`)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream=true (as OpenAI's and vLLM's servers)")
        extra = self.model_extra or {}  # fields not declared here: bookkeeping, or _UNSUPPORTED's
        for name, harmless in _UNSUPPORTED.items():
            value = extra.get(name)
            if not harmless(value):
                raise ValueError(f"{name}: not supported (got {value!r:.80})")
        # What the request sets, over the model's defaults, over SamplingParams' own.
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")}
        sampling = {**(defaults or {}), **{k: v for k, v in given.items() if v is not None}}
        return SamplingParams(
            **sampling, max_tokens=self._max_tokens(), stop=self.stop, stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed, ignore_eos=self.ignore_eos, n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=self._logit_bias(), min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=self._logprobs(),
            prompt_logprobs=self._prompt_logprobs(), allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens, bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self._structured_outputs())

    _STRUCTURED_SOURCES = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                           "guided_grammar")

    def _structured_source(self, strict: bool = True) -> str | None:
        """The field that asks for a structured output (response_format "text" asks for none); ValueError when
        several do (`strict`; else the first of them)."""
        given = [k for k in self._STRUCTURED_SOURCES if getattr(self, k) is not None]
        if isinstance(self.response_format, dict) and self.response_format.get("type") == "text":
            given.remove("response_format")
        if len(given) > 1 and strict:
            raise ValueError(f"{given[1]}: give one of {', '.join(self._STRUCTURED_SOURCES)}, not several (got "
                             f"{', '.join(given)})")
        return given[0] if given else None

    def structured_renames(self) -> dict[str, str]:
        """The engine names a structured output's fields as StructuredOutputsParams' (`structured_outputs.json`):
        to the field the client sent (for `APIError.from_value_error`)."""
        source = self._structured_source(strict=False)  # (called outside the handlers' try: never raises)
        if source is None or source == "structured_outputs":
            return {}
        return {f"structured_outputs.{k}": source for k in StructuredOutputsParams.KINDS}

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        source = self._structured_source()
        if source is None:
            return None
        try:
            return self._structured_params(source)
        except ValueError as e:  # (named as the client named it: a guided_choice's error is guided_choice's)
            raise ValueError(rename_field(str(e), self.structured_renames())[0]) from None

    def _structured_params(self, source: str) -> StructuredOutputsParams:
        if source == "response_format":
            return _response_format(self.response_format)  # type: ignore[arg-type]
        if source == "structured_outputs":
            spec = dict(self.structured_outputs)  # type: ignore[arg-type]
            spec.pop("disable_fallback", None)  # (vLLM's: whether to try another library; kvpool has one)
            for name in ("whitespace_pattern", "structural_tag"):
                if spec.pop(name, None) is not None:
                    raise ValueError(f"structured_outputs.{name}: not supported")
            unknown = sorted(set(spec) - set(_STRUCTURED_FIELDS))
            if unknown:
                raise ValueError(f"structured_outputs: unknown field {unknown[0]!r} (known: "
                                 f"{', '.join(_STRUCTURED_FIELDS)})")
            return StructuredOutputsParams(**spec)
        return StructuredOutputsParams(**{source.removeprefix("guided_"): getattr(self, source)})

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for k, v in self.logit_bias.items():
            # (JSON keys are strings: OpenAI's are token ids written out; "²" is a digit to isdigit, not to int)
            if not (k.isascii() and k.isdigit() and len(k) <= 12):
                raise ValueError(f"logit_bias: keys are token ids, got {k!r:.40}")
            out[int(k)] = v
        return out

    def _prompt_logprobs(self) -> int | None:
        v = self.prompt_logprobs
        if v is not None and type(v) is not int:
            raise ValueError(f"prompt_logprobs: must be an int in [0, {MAX_LOGPROBS}] (the top tokens), got {v!r:.40}")
        return v  # (SamplingParams checks the range)

    def _logprobs(self) -> int | None:
        """SamplingParams.logprobs: a completion's `logprobs` is the count of top tokens (0: the sampled
        token's alone, as OpenAI and vLLM read it); chat's is a flag, with the count in `top_logprobs`."""
        v = self.logprobs
        if v is None or v is False:  # (false: chat's "none", sent to a completion by clients written for both)
            return None
        if type(v) is not int:
            raise ValueError(f"logprobs: must be an int in [0, {MAX_LOGPROBS}] (the top tokens), got {v!r:.40}")
        return v  # (SamplingParams checks the range)


_STRUCTURED_FIELDS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams:
    """OpenAI's response_format: json_object (any JSON object) or json_schema ({"json_schema": {"name": ...,
    "schema": {...}}}); "text" is no constraint (handled before)."""
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format: json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                             "{...}}}")
        return StructuredOutputsParams(json=spec["schema"])
    raise ValueError(f"response_format: type must be one of text, json_object, json_schema, got {kind!r:.40}")


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


MAX_BATCH_PROMPTS = 256  # prompts in one /v1/completions body (each a request in flight: see --max-pending)


class CompletionRequest(_SamplingFields):
    # A string or token ids, or a batch: a list of strings or of token-id lists.
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    max_tokens: int | None = 16  # OpenAI's default for completions
    # The prompt before each choice's text (and, with logprobs, its tokens' log-probabilities before the
    # answer's: the first token's null, as OpenAI's and vLLM's). With max_tokens 0, the prompt alone: how
    # evaluation harnesses (lm-eval's loglikelihood) score a text.
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # (vLLM's: false tokenizes a text prompt without the BOS token)

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or a batch's in order (their choices are numbered prompt by prompt, n each)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], str | list) else [p]
        if len(batch) > MAX_BATCH_PROMPTS:
            raise ValueError(f"prompt: a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(batch)}")
        for i, one in enumerate(batch):
            if not one:
                raise ValueError("prompt: must not be empty" if len(batch) == 1 else
                                 f"prompt[{i}]: must not be empty")
        if self.suffix:
            raise ValueError("suffix: not supported")
        return batch  # type: ignore[return-value]

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt scored, nothing generated (the engine samples one token, dropped)."""
        return self.echo and self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be an int >= 1 (0 only with echo: the prompt alone), got 0")
        if self.echo_only and self.min_tokens:
            raise ValueError(f"min_tokens: must be 0 with max_tokens 0 (nothing is generated), got {self.min_tokens}")
        return 1 if self.echo_only else self.max_tokens

    def _prompt_logprobs(self) -> int | None:
        """With echo and logprobs, the prompt's tokens get the answer's top count (and more if asked)."""
        k = super()._prompt_logprobs()
        if self.echo and self.logprobs is not None and self.logprobs is not False:
            return max(self._logprobs() or 0, k or 0)
        return k


class ImageURL(BaseModel):
    url: StrictStr  # a data: URL (or file:// under --allowed-local-media-path); see kvpool.server.media
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the size


class ContentPart(BaseModel):
    """A part of a message's content: text, or an image by URL (one model rather than a tagged union, so a
    field's error names its path, `messages[0].content[1].image_url`, without the tag in it)."""

    type: Literal["text", "image_url"]
    text: StrictStr | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _has_its_field(self) -> ContentPart:
        if getattr(self, self.type) is None:
            raise ValueError(f"a part of type {self.type!r} needs a {self.type!r} field")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    # An assistant's calls of tools: the chat template gets a message's text only, so they would vanish from
    # the prompt unseen. kvpool serves no tools (`tools` is refused too): refused, unless null or empty.
    tool_calls: Any = None
    function_call: Any = None

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _no_calls(cls, v: Any) -> Any:
        if v is not None and v != []:
            raise PydanticCustomError("not_supported", "not supported (kvpool serves no tools)")
        return v

    def text(self) -> str:
        """The message's text (image parts left out); text parts joined by a line break, as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class _ChatTemplateFields(_NullIsDefault):
    # vLLM's chat template options (kvpool.engine.chat_template)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # the request's own (a server renders it only if it trusts such templates)

    def chat_options(self) -> ChatOptions:
        """The options as the renderer takes them; ValueError naming the field for ones that contradict."""
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {},
                           self.chat_template)


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None

    def _logprobs(self) -> int | None:
        if self.logprobs is not None and type(self.logprobs) is not bool:
            raise ValueError(f"logprobs: must be true or false, got {self.logprobs!r:.40}")
        if not self.logprobs:
            if self.top_logprobs:  # (OpenAI's rule: the count means nothing without the flag)
                raise ValueError("top_logprobs: needs logprobs: true")
            return None
        k = 0 if self.top_logprobs is None else self.top_logprobs
        if not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs: must be an int in [0, {MAX_LOGPROBS}], got {k}")
        return k

    @field_validator("max_tokens")
    @classmethod
    def _a_bound(cls, v: int | None) -> int | None:
        # (max_completion_tokens, when sent, bounds the answer; a max_tokens beside it must still be a bound)
        if v is not None and v < 1:  # (a custom error: its message is SamplingParams' own, without pydantic's prefix)
            raise PydanticCustomError("max_tokens", "must be an int >= 1, got {v}", {"v": v})
        return v

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return chat_messages(self.messages)

    def param_renames(self) -> dict[str, str]:
        """The engine's names for this request's fields -> the names the client sent (for
        `APIError.from_value_error`): the prompt and its images are the `messages`, and `max_tokens` is
        `max_completion_tokens` when that is the field the client set. Every server taking chats renames
        with it, so their errors name the same fields."""
        rename = {"prompt_token_ids": "messages", "mm_inputs": "messages", **self.structured_renames()}
        if self.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"
        return rename


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as chat templates read them (OpenAI's `developer` role is the templates' `system`)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


class PinRequest(BaseModel):
    """POST /v1/pins: keep a prefix's blocks on the device (kvpool.core.pins)."""

    model_config = ConfigDict(extra="forbid")

    # The prefix: text or token ids, or a chat's first messages (a system prompt), pinned as the tokens
    # every chat that starts with them shares (`LLMEngine.chat_prefix`). One of the two.
    prompt: StrictStr | TokenIds | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    ttl: float | None = Field(default=None, gt=0)  # seconds; None: until DELETE /v1/pins/{id}
    cache_salt: str | None = Field(default=None, min_length=1)
    # The template variables the chats will be sent with (their system part may read them)
    chat_template_kwargs: dict[str, Any] | None = None

    def chat_options(self) -> ChatOptions:
        return ChatOptions(template_kwargs=self.chat_template_kwargs or {})


class TokenizeRequest(_ChatTemplateFields):
    """POST /tokenize (vLLM's extension): a prompt's token ids, or a chat's (its template rendered, with the
    chat template options a chat request takes)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True  # (a prompt: the tokenizer's BOS and the like, as encoding a prompt adds)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's extension): the text of token ids."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: TokenIds
