"""Finishing a stream on another replica when the one serving it fails after the client has seen part of it.

kvpool replicas give a request the same tokens whatever their caches hold (greedy decoding, or sampling
under the request's own seed), so a stream cut mid-way can be taken up by another replica: the router sends
it the same request, drops the text the client already has, and relays the rest under the first stream's
`id` and `created`. Only the text is skipped, never events counted: two replicas may batch a request's
tokens into events differently. The replacement's text must begin with what the client has; if it does
not (a replica with other weights), the stream ends with an error event rather than a spliced answer.

A request is taken up only where the answer is one stream of text that another replica reproduces: one
choice (n = 1, one prompt), no prompt echo, and greedy or seeded.
"""

from __future__ import annotations

import json
from typing import Any


class Diverged(Exception):
    """The replacement's answer does not continue what the client has already been sent."""


def resumable(body: dict[str, Any]) -> bool:
    """Whether another replica would stream this request's answer with the same text (and nothing else a
    text skip would cut wrongly: no tool calls, no per-token logprobs, no prompt logprobs or token ids, which a
    replacement's first chunk would carry a second time, prompt_logprobs 0 included)."""
    if body.get("n") not in (None, 1) or body.get("echo") or body.get("best_of") not in (None, 1):
        return False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list):
        return False  # a batch of prompts: its choices interleave
    if any(body.get(k) for k in ("tools", "functions", "logprobs", "top_logprobs")):
        return False
    if body.get("prompt_logprobs") is not None or body.get("return_token_ids"):
        return False  # (a replacement's first chunk would carry the prompt's again; its ids, the skipped text's)
    seed, temperature, top_k = body.get("seed"), body.get("temperature"), body.get("top_k")
    greedy = (isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0) or (
        isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 1)
    return greedy or (isinstance(seed, int) and not isinstance(seed, bool))


def _choice(obj: Any) -> dict[str, Any] | None:
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def _text(choice: dict[str, Any]) -> str:
    """The text an event adds: a completion's `text`, a chat chunk's `delta.content`."""
    if isinstance(choice.get("text"), str):
        return choice["text"]
    delta = choice.get("delta")
    if isinstance(delta, dict) and isinstance(delta.get("content"), str):
        return delta["content"]
    return ""


def _set_text(choice: dict[str, Any], text: str) -> None:
    if isinstance(choice.get("text"), str):
        choice["text"] = text
    else:
        choice["delta"]["content"] = text


class StreamText:
    """What the client has been sent of a stream (`sent`, per relayed event of the first stream), and, once
    another replica takes it up, which of the replacement's events to relay and how (`follow`, which also
    counts what it relays as sent: a replacement may fail in turn)."""

    def __init__(self) -> None:
        self.text = ""  # the client's text so far
        self.id: Any = None
        self.created: Any = None
        self.finished = False  # a finish reason was sent
        self.done = False  # the end ([DONE]) was sent: nothing is owed
        self._matched = 0  # how much of `text` the current replacement has repeated
        self._errored = False  # the replacement sent an error event: its end is passed on

    def sent(self, payload: bytes) -> None:
        """An event the client was sent (its data payload)."""
        if payload.strip() == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            return  # a comment
        if isinstance(obj, dict) and self.id is None:
            self.id, self.created = obj.get("id"), obj.get("created")
        choice = _choice(obj)
        if choice is not None:
            self.text += _text(choice)
            self.finished = self.finished or choice.get("finish_reason") is not None
        self._matched = len(self.text)

    def restart(self) -> None:
        """Another replica takes the stream up from its beginning."""
        self._matched = 0
        self._errored = False

    def complete(self) -> bool:
        """Has the replacement repeated everything the client already had (so its end is a fine end)?"""
        return self._errored or self._matched >= len(self.text)

    def follow(self, payload: bytes) -> bytes | None:
        """The replacement's event as the client is to get it (None: the client has it already)."""
        if not payload:
            return None  # a comment or keep-alive
        try:
            obj = json.loads(payload)
        except ValueError:  # [DONE]
            if not self.complete():
                raise Diverged("it ended before repeating the text already sent") from None
            self.done = True
            return payload
        if not isinstance(obj, dict) or "error" in obj:
            self._errored = True
            return payload  # the replacement's own error: the client's to see
        choice = _choice(obj)
        if choice is not None:
            text, owed = _text(choice), len(self.text) - self._matched
            if owed:
                head = text[:owed]
                if head != self.text[self._matched:self._matched + len(head)]:
                    raise Diverged("its text differs from the text already sent")
                self._matched += len(head)
                text = text[len(head):]
                if not self.complete() and choice.get("finish_reason") is not None:
                    raise Diverged("it finished before repeating the text already sent")
                if not text and choice.get("finish_reason") is None:
                    return None  # all of it already sent
                _set_text(choice, text)
            elif not text and choice.get("finish_reason") is None and "usage" not in obj:
                return None  # a chat stream's role-only first chunk: the client has one
            delta = choice.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)  # (sent once, in the first stream's first chunk)
            self.text += text
            self._matched = len(self.text)
            self.finished = self.finished or choice.get("finish_reason") is not None
        elif not self.complete():
            raise Diverged("it ended before repeating the text already sent")
        if self.id is not None:
            obj["id"], obj["created"] = self.id, self.created
        return json.dumps(obj, separators=(",", ":")).encode()
