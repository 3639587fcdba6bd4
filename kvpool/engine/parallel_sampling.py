"""n > 1: n sequences sampled from one prompt, as n child requests that share the prompt's KV blocks.

The scheduler and the cache see only single-sequence requests. A request with `n` > 1 becomes n children
(`child_id`), each with `n` = 1 and, when the request is seeded, seed + i for child i (vLLM's rule: child i of
a seeded request samples as a request of its own with that seed would, so any one choice can be reproduced
alone). They share the prompt through the prefix cache: a block is cached as soon as it is scheduled, so
the children admitted in the same step as the first, or after it, hit its blocks, and the prompt is computed
and held once (each child computes only its last, partial block, at most block_size tokens: the last token
of a prompt is always computed, and a partial block is a sequence's own). With prefix caching off, each
child computes the whole prompt.

`ParentRequest` merges the children's outputs back into one `RequestOutput` under the parent's id whose
`outputs` are the choices in index order, finished when every child is; its timings are the request's
(first token: the first choice's; finished: the last's).
"""

from __future__ import annotations

from dataclasses import replace

from kvpool.engine.outputs import RequestOutput
from kvpool.engine.sampling_params import SamplingParams

_SEEDS = 1 << 64  # seeds live in [-2**63, 2**64) (SamplingParams): seed + i wraps within it


def child_id(parent_id: str, index: int) -> str:
    """The id of child `index` (vLLM's form)."""
    return f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child `index`'s sampling parameters: one sequence, and seed + index when the request is seeded. Only
    child 0 computes the prompt's log-probabilities (the request's; a child asking for them would compute the
    prompt whole, the others share child 0's blocks)."""
    seed = params.seed
    if seed is not None:
        seed += index
        if seed >= _SEEDS:
            seed -= _SEEDS
    stop = list(params.stop) if params.stop is not None else None  # type: ignore[arg-type]
    return replace(params, n=1, seed=seed, stop=stop, stop_token_ids=list(params.stop_token_ids),
                   prompt_logprobs=params.prompt_logprobs if index == 0 else None)


class ParentRequest:
    """The outputs of a request's n children so far, merged under its id."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.child_ids = [child_id(request_id, i) for i in range(n)]
        self.index = {c: i for i, c in enumerate(self.child_ids)}
        self._latest: dict[int, RequestOutput] = {}

    def merge(self, out: RequestOutput) -> RequestOutput:
        """The parent's output after a child's (`out`, under the child's id): every choice that has an
        output yet, as of its latest; finished once every child is. The prompt's cached tokens are the first
        child's (the prompt's own: the others share its blocks); the timings are the request's (see below)."""
        self._latest[self.index[out.request_id]] = out
        first = self._latest[min(self._latest)]
        zero = self._latest.get(0)
        finished = self.finished
        metrics = first.metrics
        if metrics is not None:  # the request's first token is its first choice's; it ends with its last
            seen = [o.metrics for o in self._latest.values() if o.metrics is not None]
            firsts = [m.first_token_time for m in seen if m.first_token_time is not None]
            metrics = replace(metrics, first_token_time=min(firsts, default=None), finished_time=max(
                (m.finished_time for m in seen if m.finished_time is not None), default=None) if finished else None)
        return RequestOutput(
            request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=[replace(self._latest[i].outputs[0], index=i) for i in sorted(self._latest)],
            finished=finished, num_cached_tokens=first.num_cached_tokens, metrics=metrics,
            prompt_logprobs=zero.prompt_logprobs if zero is not None else None)

    @property
    def finished(self) -> bool:
        return len(self._latest) == len(self.child_ids) and all(o.finished for o in self._latest.values())
