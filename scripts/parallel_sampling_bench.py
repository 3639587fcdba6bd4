"""n answers to one prompt (`SamplingParams(n=N)`) against N separate requests for it, prefix caching on and
off, on the default model: prompt tokens computed, wall time and the time to the first choice's first
token. Each round uses a new random prompt (no hit from an earlier round). Prints a table, then one
JSON line.

    .venv/bin/python scripts/parallel_sampling_bench.py [--n 8] [--prompt-len 1024] [--output-len 32] [--rounds 2]
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


def run(caching: bool, a: argparse.Namespace) -> dict[str, dict[str, float]]:
    llm = LLM(enable_prefix_caching=caching, kv_cache_memory="512MiB")
    rng = random.Random(0)
    llm.generate([[rng.randrange(100, 40000) for _ in range(64)]], SamplingParams(max_tokens=4, seed=1),
                 use_tqdm=False)  # (warm-up)
    runs: dict[str, list[tuple[float, int, float]]] = {"n": [], "separate": []}
    for _ in range(a.rounds):
        for mode in runs:
            prompt = [rng.randrange(100, 40000) for _ in range(a.prompt_len)]
            before = llm.engine.scheduler.stats.num_prompt_tokens
            t = time.perf_counter()
            if mode == "n":
                outs = llm.generate([prompt], SamplingParams(max_tokens=a.output_len, seed=1, n=a.n, ignore_eos=True),
                                    use_tqdm=False)
            else:
                each = [SamplingParams(max_tokens=a.output_len, seed=1 + i, ignore_eos=True) for i in range(a.n)]
                outs = llm.generate([prompt] * a.n, each, use_tqdm=False)
            wall = time.perf_counter() - t
            # (a request with n > 1 times its first token as its first choice's: the same for the separate ones)
            ttft = min(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)  # type: ignore[union-attr,operator]
            runs[mode].append((wall, llm.engine.scheduler.stats.num_prompt_tokens - before, ttft))
    return {m: {"wall_s": statistics.median(r[0] for r in rs), "prompt_tokens_computed": rs[0][1],
                "ttft_s": statistics.median(r[2] for r in rs)} for m, rs in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="medians over this many rounds")
    a = p.parse_args()
    res = {("on" if c else "off"): run(c, a) for c in (True, False)}
    rows = [[f"caching {c}", f"n={a.n}" if m == "n" else f"{a.n} requests", str(r["prompt_tokens_computed"]),
             f"{r['wall_s']:.2f}", f"{r['ttft_s']:.2f}"] for c, ms in res.items() for m, r in ms.items()]
    print(format_table(["caching", "as", "prompt tokens computed", "wall s", "first token s"], rows))
    print(json.dumps({"n": a.n, "prompt_len": a.prompt_len, "output_len": a.output_len, "caching": res}))


if __name__ == "__main__":
    main()
