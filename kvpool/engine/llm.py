"""The offline API: `LLM(model=...).generate(prompts, sampling_params)` and `.chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.core.pins import Pin, PrefixNotCached
from kvpool.engine.chat_template import ChatOptions, load_chat_template
from kvpool.engine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.lora_request import LoRARequest
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.prompts import is_single_prompt
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.multimodal import MMInput

Prompt = str | Sequence[int]
Messages = list[dict[str, str]]


class LLM:
    def __init__(self, model: str | None = None, *, enable_prefix_caching: bool = True, **kw: Any) -> None:
        if kw.get("max_num_batched_tokens") is None:
            kw["max_num_batched_tokens"] = OFFLINE_MAX_NUM_BATCHED_TOKENS  # offline: throughput first
        self.engine = LLMEngine(EngineConfig(model=model, enable_prefix_caching=enable_prefix_caching, **kw))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """The offline API over an engine already built (call it only where nothing else steps the engine:
        a server pins its `--pin-prefix` prefixes with it before it serves)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, cache_salt: str | None = None,
                 mm_inputs: Sequence[Sequence[MMInput]] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs keep the prompts' order.

        `mm_inputs[i]`: the images or ready embeddings of prompt i (see kvpool.runner.multimodal).
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model); needs
        `LLM(..., enable_lora=True)`."""
        if is_single_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        elif not isinstance(prompts, Sequence):
            raise TypeError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")
        prompts = list(prompts)  # type: ignore[arg-type]
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError("sampling_params: one per prompt, or a single one for all")
            params = list(sampling_params)
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if mm_inputs is not None and len(mm_inputs) != len(prompts):
            raise ValueError("mm_inputs: one list per prompt")
        return self._run(prompts, params, use_tqdm, cache_salt, mm_inputs, _per_prompt(lora_request, len(prompts)))

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters a prompt given none runs with: the model's generation_config.json values
        for temperature, top_p and top_k (`generation_config="vllm"`: kvpool's defaults), as vLLM's."""
        return self.engine.default_sampling_params()

    def pin_prefix(self, prompt: Prompt | None = None, *, messages: Messages | None = None, ttl: float | None = None,
                   cache_salt: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> Pin:
        """Keep a prefix (text or token ids: its full blocks) on the device for `ttl` seconds (None:
        until `unpin`), computing it first if it is not cached. Refused with ValueError over the pin
        budget (`pin_budget`, default 20% of the pool); never pins part of a prefix. For chats, give
        `messages` instead (a system prompt: `[{"role": "system", "content": ...}]`): what every chat that
        starts with them shares is pinned, in whatever form the model's chat template gives it (with the
        template variables those chats are sent with: `chat_template_kwargs`)."""
        eng = self.engine
        if (prompt is None) == (messages is None):
            raise ValueError("prompt: give the prefix as `prompt` or as `messages`, one of the two")
        if messages is not None:
            prompt = eng.chat_prefix(messages, chat_template_kwargs)  # (checked there, as ChatOptions)
        try:
            return eng.pin_prefix(prompt, ttl=ttl, cache_salt=cache_salt)
        except PrefixNotCached:
            self.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False, cache_salt=cache_salt)
            return eng.pin_prefix(prompt, ttl=ttl, cache_salt=cache_salt)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (as vLLM's `LLM.reset_prefix_cache`); pinned prefixes are computed
        again and stay pinned. False while requests run (none do between `generate` calls)."""
        return self.engine.reset_prefix_cache()

    def unpin(self, pin: Pin | str) -> bool:
        """Release a pin (its blocks become evictable); False if it had already ended."""
        if isinstance(pin, Pin):
            # By id: ids are unique to an engine (another engine's pin is never this one's), and a pin made
            # again after a reset is a new object under the same id.
            return self.engine.unpin(pin.pin_id)
        if not isinstance(pin, str):
            raise TypeError(f"pin: expected a Pin or a pin id, got {type(pin).__name__}")
        return self.engine.unpin(pin)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Like generate, with each conversation rendered by the model's chat template, or `chat_template` (a
        template's text or file) in its place (and vLLM's options: kvpool.engine.chat_template)."""
        options = ChatOptions(add_generation_prompt, continue_final_message, chat_template_kwargs or {},
                              None if chat_template is None else load_chat_template(chat_template))
        if isinstance(messages, dict):  # one message
            convs = [[messages]]
        elif isinstance(messages, Sequence) and messages and not isinstance(messages, str):
            convs = [messages] if isinstance(messages[0], dict) else list(messages)  # type: ignore[list-item]
        else:
            raise ValueError("messages: a conversation (a list of {'role': ..., 'content': ...}) or a list of them")
        ids = [self.engine.apply_chat_template(c, options=options) for c in convs]  # type: ignore[arg-type]
        return self.generate(ids, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool,
             cache_salt: str | None, mm_inputs: Sequence[Sequence[MMInput]] | None = None,
             loras: Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        eng = self.engine
        order: dict[str, int] = {}
        added: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                req = eng.add_request(p, sp, cache_salt=cache_salt, mm_inputs=mm_inputs[i] if mm_inputs else (),
                                      lora_request=loras[i] if loras else None)
                order[req.request_id] = i
                added.append(req.request_id)
        except Exception:
            for rid in added:  # a bad prompt rejects the batch without leaking the others' blocks
                eng.abort_request(rid)
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = None
        if use_tqdm and len(prompts) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generating", unit="req")
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException as e:  # a failed or interrupted step: leave an engine the next call can use
            eng.recover(pin_again=isinstance(e, Exception))  # (after a Ctrl-C, compute nothing more)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]


def _per_prompt(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None] | None:
    if lora is None or isinstance(lora, LoRARequest):
        return None if lora is None else [lora] * n
    loras = list(lora)
    if len(loras) != n:
        raise ValueError(f"lora_request: one per prompt ({n}), or a single one for all; got {len(loras)}")
    return loras
