"""Prometheus metrics of a kvpool server, fed by the engine's step reports.

Names follow vLLM's (`vllm:x` becomes `kvpool:x`) wherever vLLM has the metric, so dashboards and
load generators written for vLLM read kvpool unchanged; host-tier metrics are kvpool's own. Each
server has its own registry, so several servers can live in one process (tests do).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpool.engine.async_engine import StepReport

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self, model_name: str, *, host_tier: bool) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(**label)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=r).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(**label)

        self.running = gauge("kvpool:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("kvpool:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kvpool:kv_cache_usage_perc", "Fraction of device KV blocks held by requests (0-1).")
        self.prefix_queries = counter("kvpool:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("kvpool:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("kvpool:num_preemptions", "Requests preempted (their KV recomputed later).")
        self.prompt_tokens = counter("kvpool:prompt_tokens", "Prompt tokens of requests whose prefill completed.")
        self.generation_tokens = counter("kvpool:generation_tokens", "Tokens generated.")
        self.success = Counter("kvpool:request_success", "Requests finished, by reason.",
                               ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):  # every series from the start, at 0 (as vLLM's): a
            self.success.labels(model_name=model_name, finished_reason=reason)  # rate over a gap is then 0
        self.ttft = histogram("kvpool:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("kvpool:inter_token_latency_seconds", "Time between two output tokens.", _ITL_BUCKETS)
        self.e2e = histogram("kvpool:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.pinned_blocks = gauge("kvpool:pinned_blocks", "Device blocks held by pinned prefixes.")
        self.pins = gauge("kvpool:pinned_prefixes", "Pinned prefixes (POST /v1/pins).")
        self.prompt_rows_hits = counter("kvpool:prompt_rows_hits", "Prompt positions of prompt_logprobs requests "
                                        "scored from the prompt-row cache (a prefix hit; not recomputed).")
        self.prompt_rows_bytes = gauge("kvpool:prompt_rows_cache_bytes", "Host bytes the prompt-row cache holds.")
        self.host_tier = host_tier
        if host_tier:
            self.host_usage = gauge("kvpool:host_kv_cache_usage_perc", "Fraction of host-tier blocks pinned (0-1).")
            self.host_hits = counter("kvpool:host_prefix_cache_hits", "Prompt tokens found in the host tier.")
            self.swapped_out = counter("kvpool:kv_swap_out_blocks", "Blocks copied device -> host.")
            self.swapped_in = counter("kvpool:kv_swap_in_blocks", "Blocks copied host -> device.")
            self.swapped_out_bytes = counter("kvpool:kv_swap_out_bytes", "Bytes copied device -> host.")
            self.swapped_in_bytes = counter("kvpool:kv_swap_in_bytes", "Bytes copied host -> device.")

    def set_load(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        """The load gauges (routers read them), after a step or as of a /metrics scrape."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)

    def observe(self, s: StepReport) -> None:
        """Called on the engine thread after each step."""
        self.set_load(s.num_running, s.num_waiting, s.kv_usage)
        self.prefix_queries.inc(s.prefix_queries)
        self.prefix_hits.inc(s.prefix_hits)
        self.preemptions.inc(s.preemptions)
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.generation_tokens)
        self.prompt_rows_hits.inc(s.prompt_rows_read)
        self.prompt_rows_bytes.set(s.prompt_rows_bytes)
        for v in s.inter_token_latencies:
            self.itl.observe(v)
        for out in s.finished:
            for choice in out.outputs:  # (n > 1: each sequence, as vLLM counts its child requests)
                reason = choice.finish_reason or "abort"
                self.success.labels(model_name=self._model_name, finished_reason=reason).inc()
            m = out.metrics
            if m is None:
                continue
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
        if self.host_tier:
            self.host_usage.set(s.host_usage or 0.0)
            self.host_hits.inc(s.host_hits)
            self.swapped_out.inc(s.blocks_swapped_out)
            self.swapped_in.inc(s.blocks_swapped_in)
            self.swapped_out_bytes.inc(s.blocks_swapped_out * s.bytes_per_block)
            self.swapped_in_bytes.inc(s.blocks_swapped_in * s.bytes_per_block)
