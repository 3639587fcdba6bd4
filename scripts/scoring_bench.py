"""Scoring texts with prompt_logprobs, the shape of an evaluation harness's multiple-choice task (lm-eval's
loglikelihood requests: a few-shot context shared by every question, a question, then each of its choices,
scored with echo and logprobs 1, max_tokens 1), with the prompt-row cache (kvpool's default) and without it
(`--prompt-rows-cache 0`: such a request computes its prompt whole, as vLLM's do), on the default model.

Every system gets the same requests, all in flight at once; each round uses a new random context (no hit
from an earlier round). Reports the prompt tokens computed, the wall time (median of the rounds, the first,
cold, round apart) and how far the scores are from the row-less system's. Prints a table, then one JSON line.

    .venv/bin/python scripts/scoring_bench.py [--context-len 512] [--question-len 64] [--questions 16]
                                              [--choices 4] [--choice-len 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvpool import LLM
from kvpool.bench.report import format_table
from kvpool.engine.sampling_params import SamplingParams

SYSTEMS = {"row cache (kvpool)": "64MiB", "no row cache (as vLLM)": 0}


def workload(rng: random.Random, a: argparse.Namespace) -> list[list[int]]:
    def text(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    context = text(a.context_len)
    return [context + q + text(a.choice_len) for q in (text(a.question_len) for _ in range(a.questions))
            for _ in range(a.choices)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--choice-len", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="rounds after the cold one; the median is reported")
    a = p.parse_args()
    engines = {name: LLM(prompt_rows_cache=size, kv_cache_memory="512MiB") for name, size in SYSTEMS.items()}
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    rng = random.Random(0)
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    worst = 0.0
    for r in range(a.rounds + 1):
        prompts = workload(rng, a)
        scores = {}
        order = list(engines) if r % 2 == 0 else list(reversed(engines))  # (alternated: the machine drifts)
        for name in order:
            llm = engines[name]
            before = llm.engine.scheduler.stats.num_prompt_tokens
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[name].append((time.perf_counter() - t, llm.engine.scheduler.stats.num_prompt_tokens - before))
            scores[name] = [[t.logprob for t in o.prompt_logprobs[1:]] for o in outs]  # type: ignore[index,union-attr]
        base = scores["no row cache (as vLLM)"]
        worst = max(worst, max(abs(x - y) for s, b in zip(scores["row cache (kvpool)"], base, strict=True)
                               for x, y in zip(s, b, strict=True)))
    res = {name: {"cold_wall_s": rs[0][0], "wall_s": statistics.median(w for w, _ in rs[1:]),
                  "prompt_tokens_computed": rs[1][1]} for name, rs in runs.items()}
    n_req = a.questions * a.choices
    rows = [[name, str(r["prompt_tokens_computed"]), f"{r['cold_wall_s']:.2f}", f"{r['wall_s']:.2f}"]
            for name, r in res.items()]
    print(format_table(["system", "prompt tokens computed", "cold wall s", "wall s (median)"], rows))
    print(f"{n_req} requests of {a.context_len + a.question_len + a.choice_len} tokens; largest score difference "
          f"between the systems: {worst:.2e}")
    print(json.dumps({"requests": n_req, "context_len": a.context_len, "question_len": a.question_len,
                      "choices": a.choices, "choice_len": a.choice_len, "systems": res,
                      "max_abs_logprob_diff": worst}))


if __name__ == "__main__":
    main()
