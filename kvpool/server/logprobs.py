"""A choice's log-probabilities in OpenAI's two shapes, token by token as a stream brings them.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions (the legacy shape): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`;
with `echo`, the prompt's tokens come first (the first one's log-probability and top tokens null: nothing
precedes it), as OpenAI's and vLLM's.
vLLM's `prompt_logprobs`: one entry per prompt token, null for the first, else `{token id: {"logprob", "rank",
"decoded_token"}}` holding the prompt's token and the k most likely at its position.
A token is shown as its own decoded text, as vLLM shows it; a log-probability that underflowed to -inf in
float32 is written as -9999.0, vLLM's stand-in, since JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.runner.sampler import TokenLogprobs

# A prompt's tokens and their log-probabilities (RequestOutput.prompt_logprobs: None for the first token).
Prompt = tuple[Sequence[int], Sequence[TokenLogprobs | None]]

FLOOR = -9999.0


def _finite(v: float) -> float:
    return v if math.isfinite(v) else FLOOR


class LogprobsWriter:
    """One choice's: `next` formats the tokens not formatted yet (all of them, for a whole answer). With `echo`
    (completions), the prompt's tokens come first, in the first call, their top lists cut to `echo` tokens."""

    def __init__(self, texts: Callable[[Sequence[int]], list[str]], chat: bool, echo: int | None = None) -> None:
        self._texts = texts  # each token id's own decoded text
        self._chat = chat
        self._echo = echo
        self._sent = 0
        self._offset = 0  # (completions: where the next token's text starts in the choice's text)

    def next(self, logprobs: Sequence[TokenLogprobs] | None, prompt: Prompt | None = None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        if self._echo is not None and prompt is None:
            return None  # (the prompt's come first: nothing until they are known, n > 1's child 0 computes them)
        new: list[TokenLogprobs | None] = list(logprobs[self._sent:])
        ids = [t.token_id for t in new if t is not None]
        if self._echo is not None and prompt is not None:
            k, self._echo = self._echo, None  # (once: the first chunk)
            p_ids, p_lps = prompt
            cut = [None if t is None else t.cut(k) for t in p_lps]
            new, ids = [*cut, *new], [*p_ids, *ids]
        self._sent = len(logprobs)
        tops = [[i for i, _ in t.top] if t is not None else [] for t in new]
        texts = iter(self._texts(ids + [i for top in tops for i in top]))
        token_texts = [next(texts) for _ in ids]
        top_texts = [[next(texts) for _ in top] for top in tops]
        if self._chat:
            return {"content": [
                {"token": s, "logprob": _finite(t.logprob), "bytes": list(s.encode()),
                 "top_logprobs": [{"token": ts, "logprob": _finite(v), "bytes": list(ts.encode())}
                                  for ts, (_, v) in zip(tt, t.top, strict=True)]}
                for s, t, tt in zip(token_texts, new, top_texts, strict=True) if t is not None]}
        offsets = []
        for s in token_texts:
            offsets.append(self._offset)
            self._offset += len(s)
        return {"tokens": token_texts, "token_logprobs": [_finite(t.logprob) if t is not None else None for t in new],
                # The sampled token, then the k most likely (OpenAI: up to logprobs + 1 entries; vLLM's too).
                "top_logprobs": [_top(s, t, tt) if t is not None else None
                                 for s, t, tt in zip(token_texts, new, top_texts, strict=True)],
                "text_offset": offsets}


def _top(text: str, t: TokenLogprobs, top_texts: list[str]) -> dict[str, float]:
    return {text: _finite(t.logprob), **{s: _finite(v) for s, (_, v) in zip(top_texts, t.top, strict=True)}}


def prompt_logprobs_json(prompt: Prompt, k: int, texts: Callable[[Sequence[int]], list[str]]
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` (module doc), the top lists cut to `k` tokens."""
    lps = prompt[1]
    every = [t for t in lps if t is not None]
    wanted = [[t.token_id, *(i for i, _ in t.top[:k])] for t in every]
    decoded = iter(texts([i for w in wanted for i in w]))
    out: list[dict[str, dict[str, Any]] | None] = []
    for t in lps:
        if t is None:
            out.append(None)
            continue
        entry = {str(t.token_id): {"logprob": _finite(t.logprob), "rank": t.rank, "decoded_token": next(decoded)}}
        for r, (i, v) in enumerate(t.top[:k], start=1):
            text = next(decoded)
            entry.setdefault(str(i), {"logprob": _finite(v), "rank": r, "decoded_token": text})
        out.append(entry)
    return out
