"""The server's Prometheus series as a scraper first sees them, before any request."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.server.metrics import ServerMetrics


def test_every_finish_reason_is_a_series_at_zero_from_the_start() -> None:
    """As vLLM's: a dashboard's rate() of finished requests by reason reads 0 before the first request of
    each reason, not "no data" (and a test summing the series sees a number whatever ran before it)."""
    text = generate_latest(ServerMetrics("m", host_tier=False).registry).decode()
    samples = {(s.name, s.labels.get("finished_reason")): s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples if s.name == "kvpool:request_success_total"}
    assert samples == {("kvpool:request_success_total", r): 0.0 for r in ("stop", "length", "abort")}


def test_a_request_with_n_choices_counts_each_by_its_own_reason() -> None:
    from kvpool.engine.async_engine import StepReport
    from kvpool.engine.outputs import CompletionOutput, RequestOutput

    metrics = ServerMetrics("m", host_tier=False)
    choices = [CompletionOutput(0, "", [3], "stop"), CompletionOutput(1, "", [3, 4], "length"),
               CompletionOutput(2, "", [5, 6], "length")]
    out = RequestOutput("r", None, [1, 2], choices, finished=True)
    metrics.observe(StepReport(finished=[out]))
    text = generate_latest(metrics.registry).decode()
    samples = {s.labels["finished_reason"]: s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples if s.name == "kvpool:request_success_total"}
    assert samples == {"stop": 1.0, "length": 2.0, "abort": 0.0}
