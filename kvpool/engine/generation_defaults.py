"""Sampling defaults a model ships in its `generation_config.json`, for requests that do not set them.

Model authors tune temperature, top_p, top_k and repetition_penalty for their chat models (Qwen2.5-Instruct:
0.7, 0.8, 20, 1.05; Llama-3-Instruct: 0.6, 0.9), and vLLM applies them by default (`--generation-config auto`):
a client that leaves a field out gets the author's value, not 1.0. kvpool does the same (`generation_config="auto"`, the
default; `"vllm"` keeps kvpool's own defaults: temperature 1, no top-p or top-k cut). A value that would not
make valid sampling parameters is skipped with a warning, never a failed start. (`do_sample` is not read, as
vLLM does not: a request asks for greedy decoding with temperature 0.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvpool.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # (what vLLM reads of them too)
MODES = ("auto", "vllm")


def read_defaults(generation_config: Mapping[str, Any], mode: str = "auto") -> dict[str, Any]:
    """The sampling fields the model's generation config (its generation_config.json, parsed) sets; none for
    mode "vllm"."""
    if mode not in MODES:
        raise ValueError(f"generation_config: must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "vllm":
        return {}
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = generation_config.get(name)
        if value is None:
            continue
        try:
            SamplingParams(**{name: value}).validate()
        except (TypeError, ValueError) as e:
            log.warning("generation_config.json: %s; kvpool's default is kept", e)
            continue
        out[name] = value
    if out:
        log.info("sampling defaults from the model's generation_config.json: %s (for requests that do not set "
                 "them; --generation-config vllm keeps kvpool's)", out)
    return out
