"""Turning logits into tokens: penalties, greedy, temperature, top-k, top-p, with per-request seeded
generators; and the log-probabilities a request asks for (`logprobs`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class SamplingLike(Protocol):
    temperature: float
    top_p: float
    top_k: int


class Penalties(Protocol):
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float


# A sequence's tokens so far (prompt, then output) and how many of them are the prompt: what penalties read.
History = tuple[Sequence[int], int]


def apply_penalties(row: torch.Tensor, history: History, p: Penalties) -> torch.Tensor:
    """One row of logits penalized as vLLM does it: repetition first, over every token of the prompt and the
    output (a positive logit divided by the penalty, a negative one multiplied: transformers' processor),
    then frequency and presence over the output's (each occurrence, each distinct token)."""
    tokens, num_prompt = history
    width = row.shape[0]
    # (Ids past the LM head, such as an image placeholder, are tokens it never gives: left out, as vLLM does.)
    every = torch.as_tensor(tokens, dtype=torch.long, device=row.device)
    if p.repetition_penalty != 1:
        seen = every[every < width].unique()
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        # A penalty near 0 sends a positive logit to inf (and the softmax to NaN): the largest float instead.
        # (-inf stays: a structured output's mask put it there.)
        torch.nan_to_num_(row, posinf=torch.finfo(row.dtype).max, neginf=float("-inf"))
    out = every[num_prompt:]
    out = out[out < width]
    if out.numel() and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(out, minlength=width).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


# Below this temperature a row is greedy (vLLM's rule): dividing logits by 1e-300 would overflow to
# inf and the softmax to NaN, and no sampler tells such a temperature from 0 anyway.
SAMPLING_EPS = 1e-5


def is_greedy(p: SamplingLike | None) -> bool:
    """Whether a row takes the argmax (no parameters, or a temperature below SAMPLING_EPS)."""
    return p is None or p.temperature < SAMPLING_EPS


def biases(p: SamplingLike | None) -> dict[int, float] | None:
    """A request's logit_bias, if any (a SamplingParams field; other samplings have none)."""
    return getattr(p, "logit_bias", None) or None


def allowed(p: SamplingLike | None) -> list[int] | None:
    """A request's allowed_token_ids, if any (the only tokens it may draw)."""
    return getattr(p, "allowed_token_ids", None) or None


def sample(logits: torch.Tensor, params: list[SamplingLike], generators: list[torch.Generator | None],
           histories: Sequence[History | None] | None = None,
           banned: Sequence[Sequence[int] | None] | None = None,
           masks: Sequence[torch.Tensor | None] | None = None) -> list[int]:
    """logits: (B, vocab) float32. Rows with temperature 0 are greedy (argmax, ties to the lowest id). Rows with
    a logit_bias, a history (penalties), banned tokens (never drawn), allowed tokens (the only ones drawn) or a
    mask (a structured output's next tokens: bool per logit) have their logits changed first, on a copy: the
    caller's stay the model's (its logprobs are read from them)."""
    hist = histories or [None] * len(params)
    ban = banned or [None] * len(params)
    mask = masks or [None] * len(params)
    changed = [i for i, p in enumerate(params)
               if biases(p) or hist[i] is not None or ban[i] or allowed(p) or mask[i] is not None]
    if changed:
        logits = logits.clone()
        constrained = [i for i in changed if mask[i] is not None]
        if constrained:  # (one op for every constrained row; nothing added later lifts a -inf)
            at = torch.tensor(constrained, dtype=torch.long, device=logits.device)
            keep = torch.stack([mask[i] for i in constrained]).to(logits.device, non_blocking=True)  # type: ignore[misc]
            logits[at] = logits[at].masked_fill(~keep, float("-inf"))
        for i in changed:
            bias = biases(params[i])
            if bias:  # (its ids are checked against the LM head's width when the request is made)
                ids = list(bias)
                logits[i, ids] += torch.tensor([float(bias[t]) for t in ids], dtype=logits.dtype,
                                               device=logits.device)
            h = hist[i]
            if h is not None:
                apply_penalties(logits[i], h, params[i])  # type: ignore[arg-type]
            only = allowed(params[i])
            if only:  # (its ids are checked against the LM head's width when the request is made)
                row = torch.full_like(logits[i], float("-inf"))
                ids = torch.tensor(only, dtype=torch.long, device=logits.device)
                row[ids] = logits[i, ids]
                # allowed_token_ids that leave none of a structured output's tokens: the constraint wins
                # (drawing outside it would end the text where it is not what was asked for).
                if mask[i] is None or torch.isfinite(row).any():
                    logits[i] = row
            stops = [t for t in ban[i] or () if t < logits.shape[1]]
            if stops:
                row = logits[i].clone()
                row[stops] = float("-inf")
                if torch.isfinite(row).any():  # (bans covering every token it may draw: none banned)
                    logits[i] = row
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, p in enumerate(params):
        if is_greedy(p):
            out.append(greedy[i])
            continue
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.shape[0]:
            # Chosen on the logits, before the temperature: a huge one rounds them all to one value (a
            # float32 overflow to inf even to 0), and the k kept must still be the k largest (top_k=1 stays
            # the argmax).
            kth = torch.topk(logits[i], p.top_k).values[-1]
            row = row.masked_fill(logits[i] < kth, float("-inf"))
        min_p = getattr(p, "min_p", 0.0)
        if min_p > 0:
            # prob < min_p * max prob, in logits: below max + log(min_p) (what top-k keeps has the max).
            row = row.masked_fill(row < row.max() + math.log(min_p), float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            # Keep the smallest set whose mass reaches top_p, as transformers and vLLM do: in ascending order,
            # drop the tokens whose mass together stays within 1 - top_p (of tokens tied at the edge, the
            # later ones in sort order stay), never the most likely.
            sorted_p, idx = probs.sort()
            drop = sorted_p.cumsum(0) <= 1 - p.top_p
            drop[-1] = False
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability, its rank (1: the most likely) and the `k` most likely tokens' (most likely
    first), under the model's own distribution: the log-softmax of its logits before temperature, top-k and
    top-p (vLLM's default, "raw_logprobs"), so the numbers do not depend on how the token was drawn."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int = 1

    def cut(self, k: int) -> TokenLogprobs:
        """The same with at most `k` top tokens."""
        return self if len(self.top) <= k else TokenLogprobs(self.token_id, self.logprob, self.top[:k], self.rank)


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """logits: (B, vocab) float32, one row per token (a sampled one, or the prompt's next); ks: how many top
    tokens each row wants. A token past the LM head (an image placeholder) gets -inf, ranked last."""
    logp = torch.log_softmax(logits, dim=-1)
    width = logp.shape[1]
    ids = torch.tensor(tokens, device=logp.device)
    inside = ids < width
    picked_t = logp.gather(1, torch.where(inside, ids, 0).unsqueeze(1)).squeeze(1)
    picked_t = torch.where(inside, picked_t, float("-inf"))
    # Its rank: 1 + the tokens strictly more likely (vLLM's), a tie ranked as its best.
    ranks = ((logp > picked_t.unsqueeze(1)).sum(dim=1, dtype=torch.int32) + 1).tolist()  # (int32: half the time)
    picked = picked_t.tolist()
    k_max = max(ks)
    top_v, top_i = torch.topk(logp, k_max, dim=-1) if k_max else (logp[:, :0], logp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprobs(t, lp, tuple(zip(top_i[r][:k], top_v[r][:k], strict=True)), rank)
            for r, (t, lp, k, rank) in enumerate(zip(tokens, picked, ks, ranks, strict=True))]
