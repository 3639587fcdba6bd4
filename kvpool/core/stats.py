"""Prefix cache statistics, counted in tokens as vLLM counts them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached
    host_hits: int = 0  # of the hits, tokens found in the host tier
    # A preempted request admitted again, apart (as vLLM keeps them): its lookup covers its output too and
    # hits mostly its own blocks, which would raise the hit rate a user reads under memory pressure alone.
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit: int, preempted: bool = False) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hit
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit
