"""`kvpool bench prefix`: the shared-prefix workload on the real model, three systems in one run.

kvpool with prefix caching, kvpool without, and transformers' batched `generate` (the code a user
would otherwise write), on the same prompts and weights: greedy, ignore_eos, every request submitted
at once. Reports wall time, output and total tokens/s, TTFT mean/p50/p99, prefix hit rate, and the
ideal TTFT speedup 1/(1 - hit rate). `--workload-out` writes the token ids for
`../shared/peers/vllm-cpu/run.sh`, so vLLM-CPU runs the very same workload.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any

from kvpool.bench.report import emit, format_table
from kvpool.bench.workloads import generated_shared_prefix

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--questions", type=int, default=8, help="questions per group")
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--unique", action="store_true", help="no shared prefix: every prompt its own system prompt")
    p.add_argument("--runs", type=int, default=1, help="timed runs per system (medians reported)")
    p.add_argument("--systems", default="kvpool,kvpool-no-cache,transformers",
                   help="comma-separated: kvpool, kvpool-no-cache, kvpool-full-attention (hybrid models: every "
                        "layer kept as full attention), transformers")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--workload-out", help="write the workload (token ids) as JSON for vllm-cpu/run.sh")
    p.add_argument("--json", action="store_true")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _summary(wall: float, ttfts: list[float], n_out: int, n_prompt: int, hit_rate: float) -> dict[str, float]:
    return dict(wall_s=wall, output_tokens_per_s=n_out / wall, total_tokens_per_s=(n_out + n_prompt) / wall,
                ttft_mean_ms=1e3 * statistics.mean(ttfts), ttft_p50_ms=1e3 * _pct(ttfts, 0.5),
                ttft_p99_ms=1e3 * _pct(ttfts, 0.99), hit_rate=hit_rate)


def run_kvpool(prompts: list[list[int]], out_len: int, caching: bool, runs: int, engine_kw: dict[str, Any]
               ) -> tuple[dict[str, float], list[list[int]]]:
    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling_params import SamplingParams

    llm = LLM(**{**engine_kw, "enable_prefix_caching": caching})
    log.info("%s allocator: %d KV blocks; %d requests of full length fit while decoding",
             "hybrid" if llm.engine.config.hybrid_allocator else "uniform", llm.engine.runner.num_blocks,
             _requests_that_fit(llm, prompts, out_len))
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate([p[:64] for p in prompts[:4]], sp, use_tqdm=False)  # warm-up: first-call costs
    results = []
    tokens: list[list[int]] = []
    for _ in range(runs):
        llm.engine.kv.reset_prefix_cache()
        stats0 = (llm.engine.kv.stats.queries, llm.engine.kv.stats.hits)
        t0 = time.perf_counter()
        wall_t0 = time.time()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        q = llm.engine.kv.stats.queries - stats0[0]
        h = llm.engine.kv.stats.hits - stats0[1]
        ttfts = [o.metrics.first_token_time - wall_t0 for o in outs if o.metrics and o.metrics.first_token_time]
        # The hit rate a request sees (what its TTFT depends on): prompt tokens it did not compute at its
        # admission. The lookup counters (vLLM's prefix_cache_queries/hits) count every lookup, also those
        # of a request looked up again step after step while the pool is too full to admit it, so under
        # memory pressure they mostly measure how long requests waited: kept as lookup_hit_rate.
        n_prompt = sum(map(len, prompts))
        summary = _summary(wall, ttfts, sum(len(o.token_ids) for o in outs), n_prompt,
                           sum(o.num_cached_tokens for o in outs) / n_prompt)
        summary["lookup_hit_rate"] = h / q if q else 0.0
        results.append(summary)
        tokens = [o.token_ids for o in outs]
    return _median(results), tokens


def run_transformers(prompts: list[list[int]], out_len: int, batch: int, dtype: str, model: str | None
                     ) -> tuple[dict[str, float], list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from kvpool.runner.model_files import resolve_model

    path = resolve_model(model)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    ref.eval()

    class FirstToken(LogitsProcessor):
        def __init__(self) -> None:
            self.t: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    ttfts: list[float] = []
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            width = max(map(len, chunk))
            # Left-padded batch, as generate expects for decoder-only models.
            pad = ref.generation_config.pad_token_id or 0
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            ft = FirstToken()
            out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                               do_sample=False, logits_processor=LogitsProcessorList([ft]), pad_token_id=pad)
            ttfts += [(ft.t or time.perf_counter()) - t0] * len(chunk)
            tokens += [row[width:].tolist() for row in out]
    wall = time.perf_counter() - t0
    return _summary(wall, ttfts, sum(map(len, tokens)), sum(map(len, prompts)), 0.0), tokens


def _requests_that_fit(llm: Any, prompts: list[list[int]], out_len: int) -> int:
    """How many of the longest request the pool holds at once while they decode (every KV cache group
    counted; a sliding-window group then holds its window, not the whole context)."""
    eng = llm.engine
    n = max(map(len, prompts)) + out_len
    per_request = sum(s.max_blocks_held(n, 1) for s in eng.runner.kv_cache_specs)
    return (eng.runner.num_blocks - 1) // per_request


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def run(a: argparse.Namespace, engine_kw: dict[str, Any]) -> dict:
    prompts = generated_shared_prefix(a.groups, a.system_len, a.questions, a.question_len, seed=a.seed,
                                      shared=not a.unique)
    if a.workload_out:
        with open(a.workload_out, "w") as f:
            json.dump({"prompts": [{"ids": p} for p in prompts], "max_tokens": a.output_len}, f)
    systems: dict[str, dict[str, float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    wanted = [s.strip() for s in a.systems.split(",") if s.strip()]
    for name in wanted:
        if name == "kvpool":
            systems[name], outputs[name] = run_kvpool(prompts, a.output_len, True, a.runs, engine_kw)
        elif name == "kvpool-full-attention":  # the uniform allocator: sliding layers keep every block
            systems[name], outputs[name] = run_kvpool(prompts, a.output_len, True, a.runs,
                                                      {**engine_kw, "hybrid_allocator": False})
        elif name == "kvpool-no-cache":
            systems[name], outputs[name] = run_kvpool(prompts, a.output_len, False, a.runs, engine_kw)
        elif name == "transformers":
            systems[name], outputs[name] = run_transformers(prompts, a.output_len, a.hf_batch_size,
                                                            engine_kw.get("dtype", "bfloat16"), engine_kw.get("model"))
        else:
            raise ValueError(f"systems: unknown system {name!r}")
    hit = systems.get("kvpool", {}).get("hit_rate", 0.0)
    ideal = 1.0 / (1.0 - hit) if hit < 1 else float("inf")
    result: dict[str, Any] = dict(
        workload=dict(groups=a.groups, system_len=a.system_len, questions=a.questions,
                      question_len=a.question_len, output_len=a.output_len, shared=not a.unique,
                      requests=len(prompts)),
        systems=systems, ideal_ttft_speedup=ideal)
    if "kvpool" in systems and "kvpool-no-cache" in systems:
        result["ttft_speedup"] = systems["kvpool-no-cache"]["ttft_mean_ms"] / systems["kvpool"]["ttft_mean_ms"]
        result["ttft_speedup_of_ideal"] = result["ttft_speedup"] / ideal
        same = [a == b for a, b in zip(outputs["kvpool"], outputs["kvpool-no-cache"], strict=True)]
        # Exact in fp32 (the tests); in bf16 a near-tie can flip where the two paths round differently.
        result["outputs_identical_cache_on_off"] = all(same)
        result["outputs_identical_fraction"] = sum(same) / len(same)
    if "kvpool" in systems and "kvpool-full-attention" in systems:
        full, hyb = systems["kvpool-full-attention"], systems["kvpool"]
        result["hybrid_throughput_vs_full_attention"] = hyb["output_tokens_per_s"] / full["output_tokens_per_s"]
        result["hybrid_ttft_speedup_vs_full_attention"] = full["ttft_mean_ms"] / hyb["ttft_mean_ms"]
        result["outputs_identical_hybrid_vs_full"] = outputs["kvpool"] == outputs["kvpool-full-attention"]
    if "kvpool" in systems and "transformers" in systems:
        result["throughput_vs_transformers"] = (systems["kvpool"]["output_tokens_per_s"]
                                                / systems["transformers"]["output_tokens_per_s"])
    rows = [[n, f"{s['wall_s']:.2f}", f"{s['output_tokens_per_s']:.1f}", f"{s['total_tokens_per_s']:.0f}",
             f"{s['ttft_mean_ms']:.0f}", f"{s['ttft_p50_ms']:.0f}", f"{s['ttft_p99_ms']:.0f}", f"{s['hit_rate']:.3f}"]
            for n, s in systems.items()]
    table = format_table(["system", "wall s", "out tok/s", "total tok/s", "TTFT mean ms", "p50", "p99", "hit rate"],
                         rows)
    extra = [f"ideal TTFT speedup 1/(1-hit): {ideal:.2f}"]
    if "ttft_speedup" in result:
        extra.append(f"TTFT speedup cache on vs off: {result['ttft_speedup']:.2f} "
                     f"({100 * result['ttft_speedup_of_ideal']:.0f}% of ideal); requests with identical outputs: "
                     f"{100 * result['outputs_identical_fraction']:.0f}%")
    if "hybrid_throughput_vs_full_attention" in result:
        extra.append(f"hybrid allocator vs all layers as full attention: "
                     f"{result['hybrid_throughput_vs_full_attention']:.2f}x output throughput, "
                     f"{result['hybrid_ttft_speedup_vs_full_attention']:.2f}x TTFT; identical outputs: "
                     f"{result['outputs_identical_hybrid_vs_full']}")
    if "throughput_vs_transformers" in result:
        extra.append(f"output throughput vs transformers: {result['throughput_vs_transformers']:.2f}x")
    emit(table + "\n" + "\n".join(extra), result, a.json)
    return result
