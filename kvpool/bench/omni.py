"""`kvpool bench omni`: the thinker -> talker pipeline with stage-output caching on and off, in one run.

Two workloads, requests one at a time (so a request's first stage-1 step is its whole prefill):
- shared prefix: groups of questions after one long system prompt per group;
- images: each image asked several different questions (image placeholders first, then the question).

"on" is prefix caching (and so the stage-output cache) in both stages plus the encoder cache; "off"
is none of them: every token and every image computed. The two pipelines run side by side, request
by request. Reported per workload and mode: mean end-to-end latency and stage-1 prefill time (wall
and CPU time of the calling thread: run with OMP_NUM_THREADS=1 for the CPU time to hold all the
work), stage-1 prompt tokens computed, hit rate, encoder runs; then the stage-1 prefill speedup (CPU
time) against the ideal 1/(1 - hit rate), and whether the talker got the same inputs and emitted the
same codes. With --json the last line is one JSON object.

A workload with no requests (`--groups 0`: images only; `--images 0`: text only) is left out of the run and
the report; the flags are checked before any model loads.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from kvpool.bench.report import emit, format_table
from kvpool.bench.workloads import generated_shared_prefix
from kvpool.server.options import _positive, at_least

PATCH = 4  # the vision tower's patch side (the image side must be a multiple of it)


_count = at_least(0)


def _image_size(text: str) -> int:
    n = _positive(text)
    if n % PATCH:
        raise argparse.ArgumentTypeError(f"must be a multiple of {PATCH} (the tower's patch side), got {n}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    # (checked as they are parsed: a bad value would otherwise fail only after both pipelines are built)
    p.add_argument("--model", default=None, help="thinker: local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--groups", type=_count, default=3, help="system prompts (0: no shared-prefix workload)")
    p.add_argument("--questions", type=_positive, default=4, help="questions per system prompt, and per image")
    p.add_argument("--system-len", type=_positive, default=512)
    p.add_argument("--question-len", type=_positive, default=32)
    p.add_argument("--images", type=_count, default=3, help="images (0: no image workload)")
    p.add_argument("--image-size", type=_image_size, default=32,
                   help=f"image side; patches of {PATCH}: (side/{PATCH})^2 image tokens")
    p.add_argument("--thinker-tokens", type=_positive, default=8)
    p.add_argument("--talker-tokens", type=_positive, default=8)
    p.add_argument("--block-size", type=_positive, default=16)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="both stages (batch-invariant kernels exist for both; auto: bf16 where native)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def _workloads(a: argparse.Namespace, n_img_tokens: int) -> dict[str, list[tuple[list[int], list[Any]]]]:
    from kvpool.runner.multimodal import ImageInput

    text = generated_shared_prefix(a.groups, a.system_len, a.questions, a.question_len, seed=a.seed,
                                   token_range=(1000, 40000))
    rng = random.Random(a.seed + 1)
    gen = torch.Generator().manual_seed(a.seed)
    images = []
    for _ in range(a.images):
        pixels = torch.rand((3, a.image_size, a.image_size), generator=gen)
        for _ in range(a.questions):
            q = [rng.randrange(1000, 40000) for _ in range(a.question_len)]
            images.append(([0] * n_img_tokens + q, [ImageInput(0, pixels)]))
    loads = {"shared_prefix": [(p, []) for p in text], "images": images}
    return {name: reqs for name, reqs in loads.items() if reqs}  # (an empty one has nothing to measure)


def _pipeline(a: argparse.Namespace, caching: bool) -> Any:
    from kvpool.omni.pipeline import reference_pipeline

    pipe = reference_pipeline(a.model, enable_prefix_caching=caching, thinker_tokens=a.thinker_tokens,
                              talker_tokens=a.talker_tokens,
                              thinker_engine=dict(block_size=a.block_size, kv_cache_memory="256MiB",
                                                  skip_tokenizer_init=True,
                                                  encoder_cache_size="256MiB" if caching else "1b"),
                              talker_engine=dict(block_size=a.block_size, kv_cache_memory="64MiB"),
                              vision=dict(image_size=a.image_size, patch_size=PATCH), seed=a.seed, dtype=a.dtype)
    thinker = pipe.stages[0].engine
    # Time every thinker step, in wall time and in this thread's CPU time: on a shared machine the
    # CPU time is what the computation cost (other processes' load does not count in it). Requests
    # run one at a time, so a request's first step is its whole prefill.
    pipe.step_times = []
    step = thinker.step

    def timed_step() -> Any:
        w0, c0 = time.perf_counter(), time.thread_time()
        out = step()
        pipe.step_times.append((time.perf_counter() - w0, time.thread_time() - c0))
        return out

    thinker.step = timed_step
    pipe.generate([list(range(1000, 1064))])  # warm-up: first-call costs, nothing shared with the workloads
    return pipe


def _run(a: argparse.Namespace) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, dict[str, list[Any]]]]:
    """Both modes side by side, request by request (alternating which goes first), so drift in the
    machine's load hits both alike."""
    pipes = {"on": _pipeline(a, True), "off": _pipeline(a, False)}
    n_img = int(pipes["on"].stages[0].engine.mm.encoder.num_tokens)
    stats: dict[str, dict[str, dict[str, float]]] = {}
    outputs: dict[str, dict[str, list[Any]]] = {}
    for name, reqs in _workloads(a, n_img).items():
        acc = {m: dict(lat=[], lat_cpu=[], pre=[], pre_cpu=[], n_prompt=0, n_cached=0) for m in pipes}
        outs: dict[str, list[Any]] = {m: [] for m in pipes}
        runs0 = {m: p.stages[0].engine.mm.encoder_runs for m, p in pipes.items()}
        for i, (prompt, imgs) in enumerate(reqs):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                pipe, r = pipes[mode], acc[mode]
                pipe.step_times.clear()
                w0, c0 = time.perf_counter(), time.thread_time()
                o = pipe.generate([prompt], [imgs])[0]
                r["lat"].append(time.perf_counter() - w0)
                r["lat_cpu"].append(time.thread_time() - c0)
                r["pre"].append(pipe.step_times[0][0])
                r["pre_cpu"].append(pipe.step_times[0][1])
                r["n_prompt"] += len(prompt)
                r["n_cached"] += o.stages[0].num_cached_tokens
                outs[mode].append(o)
        stats[name] = {m: dict(latency_mean_s=statistics.mean(r["lat"]),
                               latency_cpu_mean_s=statistics.mean(r["lat_cpu"]),
                               prefill_mean_s=statistics.mean(r["pre"]), prefill_cpu_total_s=sum(r["pre_cpu"]),
                               prefill_total_s=sum(r["pre"]), prompt_tokens=r["n_prompt"],
                               computed_prompt_tokens=r["n_prompt"] - r["n_cached"],
                               hit_rate=r["n_cached"] / r["n_prompt"],
                               encoder_runs=pipes[m].stages[0].engine.mm.encoder_runs - runs0[m])
                       for m, r in acc.items()}
        outputs[name] = outs
    return stats, outputs


def _identical(on: list[Any], off: list[Any]) -> bool:
    return all(x.stages[0].token_ids == y.stages[0].token_ids and torch.equal(x.stage_inputs[0], y.stage_inputs[0])
               and x.codes == y.codes for x, y in zip(on, off, strict=True))


def run(a: argparse.Namespace) -> dict[str, Any]:
    if a.groups == 0 and a.images == 0:
        raise ValueError("--groups, --images: both 0 leave no workload to run")
    stats, outs = _run(a)
    rows = []
    result: dict[str, Any] = {}
    for name, st in stats.items():
        on, off = st["on"], st["off"]
        h = on["hit_rate"]
        speedup = off["prefill_cpu_total_s"] / on["prefill_cpu_total_s"]
        ideal = 1.0 / (1.0 - h)
        result[name] = dict(on=on, off=off, hit_rate=h, stage1_prefill_speedup=speedup,
                            stage1_prefill_speedup_wall=off["prefill_total_s"] / on["prefill_total_s"],
                            ideal_speedup=ideal, fraction_of_ideal=speedup / ideal,
                            stage2_identical=_identical(outs[name]["on"], outs[name]["off"]),
                            latency_speedup=off["latency_cpu_mean_s"] / on["latency_cpu_mean_s"],
                            latency_speedup_wall=off["latency_mean_s"] / on["latency_mean_s"],
                            encoder_runs_saved=off["encoder_runs"] - on["encoder_runs"])
        for mode, s in (("on", on), ("off", off)):
            rows.append([name, mode, 1e3 * s["latency_mean_s"], 1e3 * s["latency_cpu_mean_s"],
                         1e3 * s["prefill_mean_s"], 1e3 * s["prefill_cpu_total_s"] / len(outs[name][mode]),
                         int(s["computed_prompt_tokens"]), s["hit_rate"], int(s["encoder_runs"])])
    # The headline numbers are the shared prefix's (the images' when it was left out).
    head = result["shared_prefix" if "shared_prefix" in result else "images"]
    result.update(hit_rate=head["hit_rate"], stage1_prefill_speedup=head["stage1_prefill_speedup"],
                  ideal_speedup=head["ideal_speedup"], fraction_of_ideal=head["fraction_of_ideal"],
                  stage2_identical=all(result[n]["stage2_identical"] for n in stats),
                  encoder_runs_saved=result["images"]["encoder_runs_saved"] if "images" in result else 0)
    table = format_table(["workload", "caching", "latency ms", "latency cpu ms", "stage-1 prefill ms",
                          "prefill cpu ms", "prompt tokens computed", "hit rate", "encoder runs"], rows)
    summary = "\n".join(
        f"{n}: stage-1 prefill speedup {r['stage1_prefill_speedup']:.2f}x (CPU time; wall "
        f"{r['stage1_prefill_speedup_wall']:.2f}x), ideal {r['ideal_speedup']:.2f}x "
        f"({100 * r['fraction_of_ideal']:.0f}% of ideal), end-to-end {r['latency_speedup']:.2f}x, "
        f"stage 2 identical: {r['stage2_identical']}" for n, r in ((n, result[n]) for n in stats))
    emit(table + "\n" + summary, result, a.json)
    return result
