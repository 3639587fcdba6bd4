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
