"""Prefix cache statistics, counted in tokens as vLLM counts them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached
    host_hits: int = 0  # of the hits, tokens found in the host tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit
