"""What a structured output costs: a batch of chats answered under a JSON schema (vLLM's structured_outputs,
OpenAI's response_format json_schema) against the same chats answered freely, on the default model.

Every request generates exactly `--max-tokens` tokens (ignore_eos: past the end of its JSON, a constrained one
draws EOS alone), so both systems do the same work and tokens/s compares the cost of the masks. The first,
cold, constrained run (llguidance's view of the vocabulary is built then) is reported apart; the rest
alternate the two systems (the machine drifts) and report medians. Also reports how many answers parse as
JSON with the schema's keys. Prints a table, then one JSON line.

    .venv/bin/python scripts/structured_bench.py [--requests 8] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvpool import LLM
from kvpool.bench.report import format_table
from kvpool.engine.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}}}}


def keyed(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and set(SCHEMA["required"]) <= set(obj)  # type: ignore[arg-type]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds after the cold one; the median is reported")
    a = p.parse_args()
    llm = LLM(max_model_len=2048)
    chats = [[{"role": "user", "content": f"Describe fictional person number {i} as a JSON object with their "
                                          f"name, age, city and hobbies."}] for i in range(a.requests)]
    systems = {"free": None, "json schema": StructuredOutputsParams(json=SCHEMA)}

    def run(so: StructuredOutputsParams | None) -> tuple[float, int, int]:
        params = SamplingParams.greedy(a.max_tokens, ignore_eos=True, structured_outputs=so)
        t = time.perf_counter()
        outs = llm.chat(chats, params, use_tqdm=False)
        wall = time.perf_counter() - t
        return wall, sum(len(o.token_ids) for o in outs), sum(keyed(o.text) for o in outs)

    cold = run(systems["json schema"])
    runs: dict[str, list[tuple[float, int, int]]] = {name: [] for name in systems}
    for r in range(a.rounds):
        for name in (list(systems) if r % 2 == 0 else list(reversed(systems))):
            runs[name].append(run(systems[name]))
    res = {name: {"tokens_per_s": statistics.median(n / w for w, n, _ in rs), "valid_json": rs[-1][2]}
           for name, rs in runs.items()}
    res["json schema"]["cold_tokens_per_s"] = cold[1] / cold[0]
    ratio = res["json schema"]["tokens_per_s"] / res["free"]["tokens_per_s"]
    rows = [[name, f"{r['tokens_per_s']:.1f}", f"{r['valid_json']}/{a.requests}"] for name, r in res.items()]
    print(format_table(["system", "tokens/s (median)", "answers that parse with the schema's keys"], rows))
    print(f"constrained / free: {ratio:.3f}; the cold constrained run: {cold[1] / cold[0]:.1f} tokens/s")
    print(json.dumps({"requests": a.requests, "max_tokens": a.max_tokens, "systems": res,
                      "constrained_over_free": ratio}))


if __name__ == "__main__":
    main()
