"""The figures the benchmarks print: percentiles as numpy (and `vllm bench serve`) compute them, and medians
over runs whose rates agree with their median wall time."""

from __future__ import annotations

import pytest

from kvpool.bench.prefix import _median
from kvpool.bench.report import percentile


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5  # (nearest rank with round-half-even gave 3)
    assert percentile([1, 2, 3, 4, 5, 6], 50) == 3.5  # (... and 3 here: the other middle value)
    assert percentile(list(range(1, 65)), 99) == pytest.approx(63.37)  # not the largest, 64
    assert percentile([7.0], 99) == 7.0


def test_the_median_of_an_even_number_of_runs_keeps_rate_and_wall_time_together() -> None:
    runs = [dict(wall_s=0.4, output_tokens_per_s=160.0, total_tokens_per_s=400.0, ttft_mean_ms=10.0),
            dict(wall_s=0.8, output_tokens_per_s=80.0, total_tokens_per_s=200.0, ttft_mean_ms=30.0)]
    med = _median(runs)
    assert med["wall_s"] == pytest.approx(0.6) and med["ttft_mean_ms"] == 20.0
    assert med["output_tokens_per_s"] == pytest.approx(64 / 0.6)  # 64 tokens in the median time, not 120
    assert med["total_tokens_per_s"] == pytest.approx(160 / 0.6)
