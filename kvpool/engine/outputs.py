"""What a finished (or streaming) request returns: the shape vLLM users already know."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.engine.request import RequestMetrics
from kvpool.runner.sampler import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked (SamplingParams.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Each prompt token's log-probabilities once all are computed (SamplingParams.prompt_logprobs): None for
    # the first token, then one per token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Omni stages (stage_outputs=True), once finished: name -> (tokens computed, *D) per-token outputs.
    stage_outputs: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids
