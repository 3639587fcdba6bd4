"""`kvpool bench prefix`: the shared-prefix workload on the real model, three systems in one run.

kvpool with prefix caching, kvpool without, and transformers' batched `generate` (the code a user
would otherwise write), on the same prompts and weights: greedy, ignore_eos, every request submitted
at once. Reports wall time, output and total tokens/s, TTFT mean/p50/p99 (each request's from its own
arrival, as vLLM's harness counts it), prefix hit rate, and the ideal TTFT speedup 1/(1 - hit rate). The
kvpool systems' timed runs alternate (see `run`).
`--workload-out` writes the token ids for `../shared/peers/vllm-cpu/run.sh`, so vLLM-CPU runs the very
same workload.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import tempfile
import time
from typing import Any

from kvpool.bench.report import emit, format_table, name_list, percentile
from kvpool.bench.workloads import generated_shared_prefix
from kvpool.server.options import _positive

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Counts are checked as they are parsed: a 0 would otherwise fail only after the engines were built.
    p.add_argument("--groups", type=_positive, default=8)
    p.add_argument("--system-len", type=_positive, default=1024)
    p.add_argument("--questions", type=_positive, default=8, help="questions per group")
    p.add_argument("--question-len", type=_positive, default=64)
    p.add_argument("--output-len", type=_positive, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--unique", action="store_true", help="no shared prefix: every prompt its own system prompt")
    p.add_argument("--runs", type=_positive, default=1, help="timed runs per system (medians reported)")
    p.add_argument("--systems", default="kvpool,kvpool-no-cache,transformers",
                   help="comma-separated: kvpool, kvpool-no-cache, kvpool-full-attention (hybrid models: every "
                        "layer kept as full attention), kvpool-lora (group g's requests run with LoRA adapter "
                        "g mod --lora: several adapters in every batch), transformers")
    p.add_argument("--lora", type=_positive, default=4, help="kvpool-lora: random LoRA adapters (all linear layers)")
    p.add_argument("--lora-rank", type=_positive, default=16, help="kvpool-lora: their rank")
    p.add_argument("--hf-batch-size", type=_positive, default=16)
    p.add_argument("--workload-out", help="write the workload (token ids) as JSON for vllm-cpu/run.sh")
    p.add_argument("--no-warmup", action="store_true",
                   help="no warm-up requests before the timed runs: the first of each system's wall_s_runs is then "
                        "a fresh engine's first requests (what a user's first request meets; for the first system "
                        "listed, also the process's first)")
    p.add_argument("--json", action="store_true")


def _summary(wall: float, ttfts: list[float], n_out: int, n_prompt: int, hit_rate: float) -> dict[str, float]:
    return dict(wall_s=wall, output_tokens_per_s=n_out / wall, total_tokens_per_s=(n_out + n_prompt) / wall,
                ttft_mean_ms=1e3 * statistics.mean(ttfts), ttft_p50_ms=1e3 * percentile(ttfts, 50),
                ttft_p99_ms=1e3 * percentile(ttfts, 99), hit_rate=hit_rate)


class KVPoolSession:
    """One engine for the workload: built and warmed once, then timed run after run."""

    def __init__(self, prompts: list[list[int]], out_len: int, caching: bool, engine_kw: dict[str, Any],
                 loras: list[Any] | None = None, warmup: bool = True) -> None:
        """`loras`: each prompt's LoRARequest (None: the base model); `warmup`: a few short requests first, so
        the timed runs leave out the engine's first-call costs."""
        from kvpool.engine.config import CACHING_OPTIONS, without
        from kvpool.engine.llm import LLM
        from kvpool.engine.sampling_params import SamplingParams

        self.prompts, self.loras = prompts, loras
        kw = {**engine_kw, "enable_prefix_caching": caching}
        if not caching:  # (the tiers below the device keep cached blocks: none without caching)
            kw = without(kw, CACHING_OPTIONS)
        self.llm = llm = LLM(**kw)
        for lora in {x.lora_name: x for x in loras or () if x is not None}.values():
            llm.engine.add_lora(lora)
        log.info("%s allocator: %d KV blocks; %d requests of full length fit while decoding",
                 "hybrid" if llm.engine.config.hybrid_allocator else "uniform", llm.engine.runner.num_blocks,
                 _requests_that_fit(llm, prompts, out_len))
        self.sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        if warmup:
            llm.generate([p[:64] for p in prompts[:4]], self.sp, use_tqdm=False,
                         lora_request=loras[:4] if loras else None)
        self.results: list[dict[str, float]] = []
        self.tokens: list[list[int]] = []

    def run(self) -> None:
        llm, prompts = self.llm, self.prompts
        log.info("timed run %d of %s", len(self.results) + 1, "LoRA" if self.loras else "the base model")
        llm.engine.kv.reset_prefix_cache()
        stats0 = (llm.engine.kv.stats.queries, llm.engine.kv.stats.hits)
        t0, cpu0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, self.sp, use_tqdm=False, lora_request=self.loras)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        q = llm.engine.kv.stats.queries - stats0[0]
        h = llm.engine.kv.stats.hits - stats0[1]
        # From each request's own arrival to its first token, as vLLM's harness counts it.
        ttfts = [o.metrics.ttft for o in outs if o.metrics and o.metrics.ttft is not None]
        # The hit rate a request sees (what its TTFT depends on): prompt tokens it did not compute at its
        # first admission. The manager's counters (vLLM's prefix_cache_queries/hits, a preempted request's
        # admissions again counted apart) give the same: kept as lookup_hit_rate, a check.
        n_prompt = sum(map(len, prompts))
        summary = _summary(wall, ttfts, sum(len(o.token_ids) for o in outs), n_prompt,
                           sum(o.num_cached_tokens for o in outs) / n_prompt)
        summary["lookup_hit_rate"] = h / q if q else 0.0
        # CPU seconds of this process (all its threads): the work done, which a busy machine stretches less
        # than the wall time (threads waiting for a core are not charged).
        summary["cpu_s"] = cpu
        self.results.append(summary)
        self.tokens = [o.token_ids for o in outs]

    def summary(self) -> tuple[dict[str, Any], list[list[int]]]:
        """Medians over the runs, and each run's wall time (`wall_s_runs`: how steady the machine was; the
        fastest, `wall_s_min`, is the one a busy machine disturbed least)."""
        walls = [r["wall_s"] for r in self.results]
        med = _median(self.results)
        # The first run over the median: with --no-warmup, how much slower a fresh engine's first requests are.
        return {**med, "wall_s_runs": walls, "wall_s_min": min(walls),
                "first_run_vs_median": walls[0] / med["wall_s"]}, self.tokens


def run_transformers(prompts: list[list[int]], out_len: int, batch: int, dtype: str, model: str | None
                     ) -> tuple[dict[str, float], list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from kvpool.runner.dtypes import resolve_dtype
    from kvpool.runner.model_files import resolve_model

    path = resolve_model(model)
    # The engine's dtype (`auto` resolved as the engine resolves it on the CPU), so the outputs compare.
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype, torch.device("cpu")))
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
    """The median of each figure over the runs; the rates are the work over the median wall time (with an
    even number of runs, a median of rates would not be what the median wall time gives)."""
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    wall = med["wall_s"]
    for rate in ("output_tokens_per_s", "total_tokens_per_s"):
        med[rate] = rows[0][rate] * rows[0]["wall_s"] / wall  # (every run does the same work)
    return med


def lora_requests(a: argparse.Namespace, model: str | None, folder: str) -> list[Any]:
    """`a.lora` random adapters of the model, written under `folder`; prompt i (of group i // questions)
    gets adapter (group mod a.lora), so each group's shared prefix stays within one adapter."""
    from kvpool.engine.lora_request import LoRARequest
    from kvpool.runner.lora import write_random_adapter
    from kvpool.runner.model_files import resolve_model

    if a.lora < 1:
        raise ValueError(f"lora: kvpool-lora needs at least one adapter, got {a.lora}")
    path = resolve_model(model)
    adapters = [LoRARequest(f"bench-{i}", i + 1, str(write_random_adapter(f"{folder}/bench-{i}", path, rank=a.lora_rank,
                                                                          seed=i)))
                for i in range(a.lora)]
    return [adapters[(i // a.questions) % a.lora] for i in range(a.groups * a.questions)]


def _lora_engine_kw(a: argparse.Namespace, engine_kw: dict[str, Any]) -> dict[str, Any]:
    return {**engine_kw, "enable_lora": True, "max_loras": a.lora, "max_lora_rank": a.lora_rank}


KVPOOL_SYSTEMS = ("kvpool", "kvpool-no-cache", "kvpool-full-attention", "kvpool-lora")


def _kvpool_session(name: str, a: argparse.Namespace, prompts: list[list[int]], engine_kw: dict[str, Any],
                    warm: bool, stack: contextlib.ExitStack) -> KVPoolSession:
    """The engine of kvpool system `name` (one of KVPOOL_SYSTEMS), built and warmed; `stack` keeps the LoRA
    adapters' folder alive until the runs are over."""
    if name == "kvpool-lora":
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-lora-"))
        return KVPoolSession(prompts, a.output_len, True, _lora_engine_kw(a, engine_kw),
                             lora_requests(a, engine_kw.get("model"), folder), warmup=warm)
    if name == "kvpool-full-attention":  # the uniform allocator: sliding layers keep every block
        engine_kw = {**engine_kw, "hybrid_allocator": False}
    return KVPoolSession(prompts, a.output_len, name != "kvpool-no-cache", engine_kw, warmup=warm)


def check_engine_flags(engine_kw: dict[str, Any]) -> None:
    """Refuse the engine flags that the systems set themselves: given, they would be overridden silently (or,
    for the allocator, turn the hybrid-vs-full-attention comparison into uniform vs uniform)."""
    from kvpool.engine.config import RunnerConfig

    if engine_kw.get("enable_prefix_caching") is False:
        raise ValueError("--no-prefix-caching: not a bench prefix flag; run --systems kvpool-no-cache")
    if engine_kw.get("hybrid_allocator") is False:
        raise ValueError("--no-hybrid-allocator: not a bench prefix flag; run --systems kvpool,kvpool-full-attention "
                         "(kvpool-full-attention keeps every layer as full attention, beside kvpool's hybrid "
                         "allocator)")
    defaults = RunnerConfig.__dataclass_fields__
    for field, flag, instead in (("max_loras", "--max-loras", "--lora (how many adapters)"),
                                 ("max_lora_rank", "--max-lora-rank", "--lora-rank")):
        if field in engine_kw and engine_kw[field] != defaults[field].default:
            raise ValueError(f"{flag}: not a bench prefix flag; the kvpool-lora system sets it from {instead}")


def run(a: argparse.Namespace, engine_kw: dict[str, Any]) -> dict:
    wanted = name_list("systems", a.systems, (*KVPOOL_SYSTEMS, "transformers"))
    check_engine_flags(engine_kw)  # (before any engine is built)
    prompts = generated_shared_prefix(a.groups, a.system_len, a.questions, a.question_len, seed=a.seed,
                                      shared=not a.unique)
    if a.workload_out:
        with open(a.workload_out, "w") as f:
            json.dump({"prompts": [{"ids": p} for p in prompts], "max_tokens": a.output_len}, f)
    systems: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    warm = not a.no_warmup
    with contextlib.ExitStack() as stack:
        # Every kvpool system is built (and warmed) first, then their timed runs alternate, the order reversed
        # every other round (A B, B A, A B): a machine whose speed drifts during the invocation, or the
        # second engine of a process running slower than the first, weighs on all of them alike. Ran one
        # system after the other, Gemma-3's two allocators measured 1.02x one way round and 0.91x the other.
        sessions = {name: _kvpool_session(name, a, prompts, engine_kw, warm, stack)
                    for name in wanted if name in KVPOOL_SYSTEMS}
        order = list(sessions.items())
        for _ in range(a.runs):
            for _, session in order:
                session.run()
            order.reverse()
        for name, session in sessions.items():
            systems[name], outputs[name] = session.summary()
        del sessions, order
    if "transformers" in wanted:
        systems["transformers"], outputs["transformers"] = run_transformers(
            prompts, a.output_len, a.hf_batch_size, engine_kw.get("dtype", "auto"), engine_kw.get("model"))
    systems = {name: systems[name] for name in wanted}
    hit = systems.get("kvpool", {}).get("hit_rate")  # (the ideal is kvpool's with caching: None without it)
    ideal = None if hit is None else 1.0 / (1.0 - hit) if hit < 1 else float("inf")
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
    if "kvpool" in systems and "kvpool-lora" in systems:
        result["lora_time_ratio"] = systems["kvpool-lora"]["wall_s"] / systems["kvpool"]["wall_s"]
        result["lora_ttft_ratio"] = systems["kvpool-lora"]["ttft_mean_ms"] / systems["kvpool"]["ttft_mean_ms"]
        result["lora_time_ratio_min"] = systems["kvpool-lora"]["wall_s_min"] / systems["kvpool"]["wall_s_min"]
        result["lora_cpu_ratio"] = systems["kvpool-lora"]["cpu_s"] / systems["kvpool"]["cpu_s"]
        # Run i of each ran back to back.
        result["lora_time_ratio_runs"] = [b / a for a, b in zip(systems["kvpool"]["wall_s_runs"],
                                                                systems["kvpool-lora"]["wall_s_runs"], strict=True)]
    if "kvpool" in systems and "transformers" in systems:
        result["throughput_vs_transformers"] = (systems["kvpool"]["output_tokens_per_s"]
                                                / systems["transformers"]["output_tokens_per_s"])
    rows = [[n, f"{s['wall_s']:.2f}", f"{s['output_tokens_per_s']:.1f}", f"{s['total_tokens_per_s']:.0f}",
             f"{s['ttft_mean_ms']:.0f}", f"{s['ttft_p50_ms']:.0f}", f"{s['ttft_p99_ms']:.0f}", f"{s['hit_rate']:.3f}"]
            for n, s in systems.items()]
    table = format_table(["system", "wall s", "out tok/s", "total tok/s", "TTFT mean ms", "p50", "p99", "hit rate"],
                         rows)
    extra = [] if ideal is None else [f"ideal TTFT speedup 1/(1-hit): {ideal:.2f}"]
    if "ttft_speedup" in result:
        extra.append(f"TTFT speedup cache on vs off: {result['ttft_speedup']:.2f} "
                     f"({100 * result['ttft_speedup_of_ideal']:.0f}% of ideal); requests with identical outputs: "
                     f"{100 * result['outputs_identical_fraction']:.0f}%")
    if "hybrid_throughput_vs_full_attention" in result:
        extra.append(f"hybrid allocator vs all layers as full attention: "
                     f"{result['hybrid_throughput_vs_full_attention']:.2f}x output throughput, "
                     f"{result['hybrid_ttft_speedup_vs_full_attention']:.2f}x TTFT; identical outputs: "
                     f"{result['outputs_identical_hybrid_vs_full']}")
    if "lora_time_ratio" in result:
        extra.append(f"{a.lora} LoRA adapters (rank {a.lora_rank}, all linear layers) vs the base model alone: "
                     f"{result['lora_time_ratio']:.2f}x wall time (fastest runs: "
                     f"{result['lora_time_ratio_min']:.2f}x), {result['lora_cpu_ratio']:.2f}x CPU time, "
                     f"{result['lora_ttft_ratio']:.2f}x TTFT")
    if "throughput_vs_transformers" in result:
        extra.append(f"output throughput vs transformers: {result['throughput_vs_transformers']:.2f}x")
    emit(table + "\n" + "\n".join(extra), result, a.json)
    return result
