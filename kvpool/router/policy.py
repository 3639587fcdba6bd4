"""Choosing a replica: the longest cached prefix traded against load.

    score(r) = cached(r) / prompt_blocks - beta * (load(r) - mean_load) / max(floor, mean_load) - gamma * kv_usage(r)

`cached(r)` is the tier-weighted length of r's cached prefix of this prompt (`kvpool.router.index`), so the
first term is the fraction of the prompt r would not compute. The second is r's load relative to the
fleet's mean: both terms are dimensionless, so `beta` is an exchange rate (beta = 1: a replica twice as
loaded as the mean gives up a whole prompt's worth of cache affinity). `floor` (2 requests) keeps a nearly
idle fleet from treating one request more as an overload: the next turn of a chat that just finished on a
replica still goes back to it. That bounds how far one hot prefix
can pile onto the replica holding it (production-stack PR 1035 describes the pile-up of a pure cache-aware
router): once its load runs ahead, the others win the prefix too, and then hold it as well.

`load(r)` must not vanish between requests. A router whose only load signal is its own in-flight count
sees 0 everywhere when clients wait for each answer before the next request (a multi-turn chat) and then
sends everything to one replica (reported against another router: Infera PR 103). Here load is the larger
of the requests in flight through this router and the replica's own running + waiting count (polled from
its /metrics, which also counts traffic that bypassed the router), plus `recent(r)`, an exponentially
decaying count of the requests just routed to r (half-life `recent_half_life_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ReplicaLoad:
    in_flight: int = 0  # requests sent through this router and not finished
    running: int = 0  # from the replica's /metrics
    waiting: int = 0
    kv_usage: float = 0.0
    recent: float = 0.0  # decayed count of recent assignments
    recent_at: float = 0.0
    polled_at: float = 0.0  # when running/waiting were read
    done_at: float = 0.0  # when a request through this router last finished there

    def decay(self, now: float, half_life_s: float) -> None:
        if self.recent and now > self.recent_at:
            self.recent *= math.exp(-(now - self.recent_at) * math.log(2) / half_life_s)
        self.recent_at = now

    @property
    def load(self) -> float:
        # A poll older than our last completion there still counts that request: ignore it until the next.
        polled = self.running + self.waiting if self.polled_at >= self.done_at else 0
        return max(self.in_flight, polled) + self.recent


@dataclass
class Choice:
    replica: str
    score: float
    matched_blocks: int  # longest cached prefix on the chosen replica, in blocks
    reason: str  # "prefix" (cache affinity decided), "load" (no replica had a prefix), "only" (one candidate)


def choose(candidates: list[str], matched: dict[str, tuple[int, float]], loads: dict[str, ReplicaLoad],
           prompt_blocks: int, *, beta: float = 1.0, gamma: float = 0.2, floor: float = 2.0, tie_break: int = 0
           ) -> Choice:
    if not candidates:
        raise ValueError("candidates: no replica to choose from")
    if len(candidates) == 1:
        r = candidates[0]
        return Choice(r, 0.0, matched.get(r, (0, 0.0))[0], "only")
    mean = sum(loads[r].load for r in candidates) / len(candidates)
    denom = max(floor, mean)
    best: tuple[float, float, int] | None = None
    best_r = candidates[0]
    n = len(candidates)
    for i, r in enumerate(candidates):
        ld = loads[r]
        frac = matched.get(r, (0, 0.0))[1] / prompt_blocks if prompt_blocks else 0.0
        score = frac - beta * (ld.load - mean) / denom - gamma * ld.kv_usage
        # Ties (all cold, equal load): lower load, then rotate so cold traffic spreads.
        key = (score, -ld.load, -((i - tie_break) % n))
        if best is None or key > best:
            best, best_r = key, r
    assert best is not None
    any_prefix = any(matched.get(r, (0, 0.0))[0] for r in candidates)
    return Choice(best_r, best[0], matched.get(best_r, (0, 0.0))[0], "prefix" if any_prefix else "load")
