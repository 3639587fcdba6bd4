"""`kvpool bench omni`: the thinker -> talker pipeline with stage-output caching on and off, in one run.

Two workloads, requests one at a time (so a request's stage-1 time to first token is its prefill):
- shared prefix: groups of questions after one long system prompt per group;
- images: each image asked several different questions (image placeholders first, then the question).

"on" is prefix caching (and so the stage-output cache) in both stages plus the encoder cache; "off"
is none of them: every token and every image computed. Reported per workload and mode: mean
end-to-end latency, mean stage-1 prefill time (TTFT), stage-1 prompt tokens computed, hit rate,
encoder runs; then the stage-1 prefill speedup against the ideal 1/(1 - hit rate), and whether the
talker got the same inputs and emitted the same codes. With --json the last line is one JSON object.
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="thinker: local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--questions", type=int, default=4, help="questions per system prompt, and per image")
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--images", type=int, default=3)
    p.add_argument("--image-size", type=int, default=32, help="image side; patches of 4: (side/4)^2 image tokens")
    p.add_argument("--thinker-tokens", type=int, default=8)
    p.add_argument("--talker-tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
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
    return {"shared_prefix": [(p, []) for p in text], "images": images}


def _run_mode(a: argparse.Namespace, caching: bool) -> tuple[dict[str, dict[str, float]], dict[str, list[Any]]]:
    from kvpool.omni.pipeline import reference_pipeline

    pipe = reference_pipeline(a.model, enable_prefix_caching=caching, thinker_tokens=a.thinker_tokens,
                              talker_tokens=a.talker_tokens,
                              thinker_engine=dict(block_size=a.block_size, kv_cache_memory="256MiB",
                                                  encoder_cache_size="256MiB" if caching else "1b"),
                              talker_engine=dict(block_size=a.block_size, kv_cache_memory="64MiB"),
                              vision=dict(image_size=a.image_size, patch_size=4), seed=a.seed)
    thinker = pipe.stages[0].engine
    assert thinker.mm.encoder is not None
    pipe.generate([list(range(1000, 1064))])  # warm-up: first-call costs, nothing shared with the workloads
    stats: dict[str, dict[str, float]] = {}
    outputs: dict[str, list[Any]] = {}
    for name, reqs in _workloads(a, int(thinker.mm.encoder.num_tokens)).items():
        lat, ttft, outs = [], [], []
        n_prompt = n_cached = 0
        runs0 = thinker.mm.encoder_runs
        for prompt, imgs in reqs:
            t0 = time.perf_counter()
            o = pipe.generate([prompt], [imgs])[0]
            lat.append(time.perf_counter() - t0)
            m = o.stages[0].metrics
            assert m is not None and m.ttft is not None
            ttft.append(m.ttft)
            n_prompt += len(prompt)
            n_cached += o.stages[0].num_cached_tokens
            outs.append(o)
        stats[name] = dict(latency_mean_s=statistics.mean(lat), prefill_mean_s=statistics.mean(ttft),
                           prefill_total_s=sum(ttft), prompt_tokens=n_prompt,
                           computed_prompt_tokens=n_prompt - n_cached,
                           hit_rate=n_cached / n_prompt, encoder_runs=thinker.mm.encoder_runs - runs0,
                           images=len(reqs) if name == "images" else 0)
        outputs[name] = outs
    return stats, outputs


def _identical(on: list[Any], off: list[Any]) -> bool:
    return all(x.stages[0].token_ids == y.stages[0].token_ids and torch.equal(x.stage_inputs[0], y.stage_inputs[0])
               and x.codes == y.codes for x, y in zip(on, off, strict=True))


def run(a: argparse.Namespace) -> dict[str, Any]:
    on, out_on = _run_mode(a, caching=True)
    off, out_off = _run_mode(a, caching=False)
    rows = []
    result: dict[str, Any] = {}
    for name in on:
        h = on[name]["hit_rate"]
        speedup = off[name]["prefill_total_s"] / on[name]["prefill_total_s"]
        ideal = 1.0 / (1.0 - h)
        same = _identical(out_on[name], out_off[name])
        result[name] = dict(on=on[name], off=off[name], hit_rate=h, stage1_prefill_speedup=speedup,
                            ideal_speedup=ideal, fraction_of_ideal=speedup / ideal, stage2_identical=same,
                            latency_speedup=off[name]["latency_mean_s"] / on[name]["latency_mean_s"],
                            encoder_runs_saved=off[name]["encoder_runs"] - on[name]["encoder_runs"])
        for mode, s in (("on", on[name]), ("off", off[name])):
            rows.append([name, mode, 1e3 * s["latency_mean_s"], 1e3 * s["prefill_mean_s"],
                         int(s["computed_prompt_tokens"]), s["hit_rate"], int(s["encoder_runs"])])
    sp = result["shared_prefix"]
    result.update(hit_rate=sp["hit_rate"], stage1_prefill_speedup=sp["stage1_prefill_speedup"],
                  ideal_speedup=sp["ideal_speedup"], fraction_of_ideal=sp["fraction_of_ideal"],
                  stage2_identical=all(result[n]["stage2_identical"] for n in on),
                  encoder_runs_saved=result["images"]["encoder_runs_saved"])
    table = format_table(["workload", "caching", "latency ms", "stage-1 prefill ms", "prompt tokens computed",
                          "hit rate", "encoder runs"], rows)
    summary = "\n".join(
        f"{n}: stage-1 prefill speedup {result[n]['stage1_prefill_speedup']:.2f}x, "
        f"ideal {result[n]['ideal_speedup']:.2f}x "
        f"({100 * result[n]['fraction_of_ideal']:.0f}% of ideal), end-to-end {result[n]['latency_speedup']:.2f}x, "
        f"stage 2 identical: {result[n]['stage2_identical']}" for n in on)
    emit(table + "\n" + summary, result, a.json)
    return result
