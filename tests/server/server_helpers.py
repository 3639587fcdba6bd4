"""Helpers of the server tests: an engine on the tiny chat Llama, and a reader of /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvpool.engine.engine import LLMEngine

BLOCK = 16


def make_engine(model_dir: Path, **kw: object) -> LLMEngine:
    args: dict[str, object] = dict(model=str(model_dir), dtype="float32", num_blocks=256, block_size=BLOCK,
                                   max_model_len=512, max_num_batched_tokens=256)
    args.update(kw)
    return LLMEngine(**args)  # type: ignore[arg-type]


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics, summed over the samples that carry `labels` (0 for a labelled series not
    yet created; a KeyError for a metric that does not exist)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    total, seen = 0.0, False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total, seen = total + s.value, True
    if not seen and not labels:
        raise KeyError(name)
    return total
