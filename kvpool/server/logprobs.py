"""A choice's log-probabilities in OpenAI's two shapes, token by token as a stream brings them.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions (the legacy shape): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
A token is shown as its own decoded text, as vLLM shows it; a log-probability that underflowed to -inf in
float32 is written as -9999.0, vLLM's stand-in, since JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.runner.sampler import TokenLogprobs

FLOOR = -9999.0


def _finite(v: float) -> float:
    return v if math.isfinite(v) else FLOOR


class LogprobsWriter:
    """One choice's: `next` formats the tokens not formatted yet (all of them, for a whole answer)."""

    def __init__(self, texts: Callable[[Sequence[int]], list[str]], chat: bool) -> None:
        self._texts = texts  # each token id's own decoded text
        self._chat = chat
        self._sent = 0
        self._offset = 0  # (completions: where the next token's text starts in the choice's text)

    def next(self, logprobs: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        new = logprobs[self._sent:]
        self._sent = len(logprobs)
        ids = [t.token_id for t in new]
        tops = [[i for i, _ in t.top] for t in new]
        texts = iter(self._texts(ids + [i for top in tops for i in top]))
        token_texts = [next(texts) for _ in ids]
        top_texts = [[next(texts) for _ in top] for top in tops]
        if self._chat:
            return {"content": [
                {"token": s, "logprob": _finite(t.logprob), "bytes": list(s.encode()),
                 "top_logprobs": [{"token": ts, "logprob": _finite(v), "bytes": list(ts.encode())}
                                  for ts, (_, v) in zip(tt, t.top, strict=True)]}
                for s, t, tt in zip(token_texts, new, top_texts, strict=True)]}
        offsets = []
        for s in token_texts:
            offsets.append(self._offset)
            self._offset += len(s)
        return {"tokens": token_texts, "token_logprobs": [_finite(t.logprob) for t in new],
                # The sampled token, then the k most likely (OpenAI: up to logprobs + 1 entries; vLLM's too).
                "top_logprobs": [_top(s, t, tt) for s, t, tt in zip(token_texts, new, top_texts, strict=True)],
                "text_offset": offsets}


def _top(text: str, t: TokenLogprobs, top_texts: list[str]) -> dict[str, float]:
    return {text: _finite(t.logprob), **{s: _finite(v) for s, (_, v) in zip(top_texts, t.top, strict=True)}}
