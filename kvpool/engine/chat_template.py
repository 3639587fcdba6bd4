"""Rendering a chat with the model's template: the options a request may set (vLLM's), and the one function
every renderer calls (the engine, the server's image path, the router's keys), so that a router keys a chat by
exactly the tokens its replica will run.

- `add_generation_prompt` (default true): open the assistant's turn after the messages.
- `continue_final_message`: leave the last message (an assistant's) open, to be continued: a prefilled
  answer. Not with `add_generation_prompt` (vLLM's rule: the two contradict).
- `chat_template_kwargs`: extra variables for the template (say `enable_thinking`); a name the renderer itself
  takes (`tokenize`, `tools`, ...) or a function of the template's (`raise_exception`, `range`, ...) is
  refused, never passed on.
- `template`: a template of the request's own in place of the model's (vLLM's `chat_template`; a server takes
  it only with --trust-request-chat-template). A model without one, or whose template should be replaced for
  every request, takes `--chat-template` (`load_chat_template`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any


@functools.cache
def _renderer_parameters() -> frozenset[str]:
    """Names a template variable must not take: transformers' renderers' own parameters (it would change how the
    chat is rendered or returned, or collide with an argument: `self`, `conversations`), and the template's
    callable globals (jinja2's `range`, `namespace`, ...; transformers' `raise_exception`, `strftime_now`),
    which a JSON value would replace with something no template can call."""
    from jinja2.defaults import DEFAULT_NAMESPACE
    from transformers import PreTrainedTokenizerBase
    from transformers.utils import chat_template_utils

    names = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    render = getattr(chat_template_utils, "render_jinja_template", None)
    if render is not None:
        names |= set(inspect.signature(render).parameters)
    return frozenset(names - {"kwargs"} | {"messages", "raise_exception", "strftime_now"} | set(DEFAULT_NAMESPACE))


MAX_TEMPLATE_CHARS = 1 << 20  # a chat template's text at most (the largest models' are ~20k characters)


def load_chat_template(value: str, field: str = "chat_template") -> str:
    """A chat template given as a file's path or as the template's text (vLLM's rule: a path that exists is
    read; text with a Jinja delimiter or a line break is the template; anything else is a path mistyped)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{field}: a chat template's file or text, got {value!r:.40}")
    if len(value) < 4096 and os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read(MAX_TEMPLATE_CHARS + 1)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{field}: {value!r:.80} cannot be read as UTF-8 text ({e})") from None
        if not value.strip():
            raise ValueError(f"{field}: the file is empty")
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"{field}: {value!r:.80} is not a file, nor a template's text (no '{{' in it)")
    if len(value) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"{field}: at most {MAX_TEMPLATE_CHARS} characters, got more")
    return value


@dataclass(frozen=True)
class ChatOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    template: str | None = None  # (the request's own; None: the model's)

    def __post_init__(self) -> None:
        if self.template is not None and (not isinstance(self.template, str) or not self.template.strip()
                                          or len(self.template) > MAX_TEMPLATE_CHARS):
            raise ValueError(f"chat_template: a template's text (at most {MAX_TEMPLATE_CHARS} characters), got "
                             f"{self.template!r:.40}")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message: true leaves the last message open to be continued; "
                             "it needs add_generation_prompt: false")
        if not isinstance(self.template_kwargs, Mapping):
            raise ValueError(f"chat_template_kwargs: a map of template variables, got "
                             f"{type(self.template_kwargs).__name__}")
        for k in self.template_kwargs:
            if not isinstance(k, str) or not k.isidentifier():
                raise ValueError(f"chat_template_kwargs: keys are template variable names, got {k!r:.40}")
            if k in _renderer_parameters():
                raise ValueError(f"chat_template_kwargs: {k!r} is a name of the renderer's own (an option or a "
                                 f"function of the template), not a template variable")


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], options: ChatOptions | None = None, *,
                lock: AbstractContextManager[Any] | None = None, max_chars: int | None = None) -> list[int]:
    """The token ids of `messages` under the tokenizer's chat template and `options`: the template rendered to
    text, then the text encoded (what transformers' tokenize=True does). Only the encoding holds `lock` (the
    tokenizer's, which the engine's thread decodes under): a template, a request's own above all, may take a
    while to render. A text over `max_chars` is refused before it is encoded (a short template can render
    gigabytes)."""
    o = options or ChatOptions()
    kw: dict[str, Any] = dict(o.template_kwargs)
    if o.continue_final_message:  # (a keyword older transformers lack: passed only when set)
        kw["continue_final_message"] = True
    if o.template is not None:
        kw["chat_template"] = o.template
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=o.add_generation_prompt, tokenize=False,
                                         **kw)
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"messages: the chat renders to {len(text)} characters, more than any prompt this model "
                         f"takes ({max_chars})")
    with lock if lock is not None else contextlib.nullcontext():
        return list(tokenizer.encode(text, add_special_tokens=False))
