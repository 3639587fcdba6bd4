#!/usr/bin/env python
"""Where an engine step's time goes outside the forward: scheduling, attention metadata, the step's update
(sampled tokens appended, finished requests freed), per step, for the hybrid allocator against the uniform
one on the same workload (`kvpool bench prefix`'s shared-prefix prompts).

Both engines are built and warmed first; their runs then alternate (A B, B A, ...), since this machine's
speed drifts. Prints one line per run and, last, one JSON line with every run's figures.

  .venv/bin/python scripts/step_overhead.py --model gemma-3-270m --kv-cache-memory 256MiB --runs 3
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from kvpool.bench.workloads import generated_shared_prefix
from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams


def _timed(acc: dict[str, float], calls: dict[str, int], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, adding its time to acc[key] and counting its calls in calls[key]."""
    def wrapper(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            acc[key] += time.perf_counter() - t
            calls[key] += 1
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    prompts = generated_shared_prefix(a.groups, 1024, a.questions, 64, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    engines: dict[str, tuple[LLM, dict[str, float], dict[str, int]]] = {}
    for name, hybrid in (("hybrid", True), ("uniform", False)):
        llm = LLM(model=a.model, kv_cache_memory=a.kv_cache_memory, hybrid_allocator=hybrid)
        llm.generate([p[:64] for p in prompts[:4]], sp, use_tqdm=False)
        acc: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        eng = llm.engine
        eng.scheduler.schedule = _timed(acc, calls, "schedule", eng.scheduler.schedule)
        eng.scheduler.update_from_output = _timed(acc, calls, "update", eng.scheduler.update_from_output)
        eng.runner._metadata = _timed(acc, calls, "metadata", eng.runner._metadata)
        # Swaps + metadata + forward + sampling.
        eng.runner.execute = _timed(acc, calls, "execute", eng.runner.execute)
        eng.step = _timed(acc, calls, "step", eng.step)
        engines[name] = (llm, acc, calls)
    rows = []
    order = list(engines)
    for run in range(a.runs):
        for name in order:
            llm, acc, calls = engines[name]
            acc.clear()
            calls.clear()
            llm.engine.kv.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t
            n = calls["step"]
            per_step = {k: 1000 * v / n for k, v in acc.items()}
            per_step["forward"] = per_step["execute"] - per_step["metadata"]
            rows.append(dict(run=run, allocator=name, wall_s=wall, steps=n, ms_per_step=per_step))
            print(f"run {run} {name:8s} wall {wall:6.2f} s, {n} steps; ms a step: "
                  + ", ".join(f"{k} {per_step[k]:.2f}" for k in ("schedule", "metadata", "update", "forward")),
                  flush=True)
        order.reverse()
    print(json.dumps(dict(model=a.model, kv_cache_memory=a.kv_cache_memory, runs=rows)))


if __name__ == "__main__":
    main()
