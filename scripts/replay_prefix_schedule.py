#!/usr/bin/env python
"""Replay `kvpool bench prefix`'s workload through the real scheduler and KV cache manager with a model's
layer groups, the forward stubbed out (every sampled token is the same), in seconds instead of minutes.

The caching decisions do not depend on the model's numbers, so the hit rates and step counts equal the
real engine's for the same flags. Prints, for the hybrid allocator (Gemma-3 270M's groups: five sliding
groups of window 512 and one full group) and the uniform one at the same KV memory: the hit rate the
requests saw (cached prompt tokens at admission), the lookup hit rate (vLLM's counters: every lookup,
also a waiting request's repeated ones), steps and preemptions.

  .venv/bin/python scripts/replay_prefix_schedule.py [--blocks-hybrid 1024 --blocks-uniform 170]

With `--trace FILE` it replays a make_trace trace through the manager alone instead (`kvpool.bench.replay`,
concurrency 4), Gemma-3's groups at each `--blocks-hybrid` against the uniform allocator at the same
memory (a uniform block holds all six groups' layers: blocks // 6).
"""

from __future__ import annotations

import argparse
import json

from kvpool.bench.workloads import generated_shared_prefix
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from kvpool.engine.request import Request
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.scheduler import Scheduler

BS = 16


def replay(hybrid: bool, num_blocks: int, prompts: list[list[int]], out_len: int) -> dict[str, float]:
    specs = ([SlidingWindowSpec(block_size=BS, sliding_window=512)] * 5 + [FullAttentionSpec(block_size=BS)]
             if hybrid else [FullAttentionSpec(block_size=BS)])
    kv = KVCacheManager(num_blocks, BS, specs=specs)
    sch = Scheduler(kv, max_num_batched_tokens=2048, max_num_seqs=64, enable_chunked_prefill=True)
    hasher = BlockHasher(BS)
    reqs = [Request(str(i), p, SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0), hasher=hasher)
            for i, p in enumerate(prompts)]
    for r in reqs:
        sch.add_request(r)
    steps = 0
    while sch.has_unfinished():
        out = sch.schedule()
        done = {s.request.request_id: 7 for s in out.scheduled if s.request.num_computed_tokens >= s.request.num_tokens}
        sch.update_from_output(out, done)
        steps += 1
    n_prompt = sum(map(len, prompts))
    return dict(hit_rate=sum(r.metrics.num_cached_tokens for r in reqs) / n_prompt,
                lookup_hit_rate=kv.stats.hits / kv.stats.queries, steps=steps,
                preemptions=sch.stats.num_preemptions)


def replay_trace(path: str, blocks: list[int]) -> None:
    from kvpool.bench.replay import replay as replay_manager
    from kvpool.bench.workloads import load_trace

    trace = load_trace(path)
    rows = []
    for n in blocks:
        specs = [SlidingWindowSpec(block_size=BS, sliding_window=512)] * 5 + [FullAttentionSpec(block_size=BS)]
        hyb = replay_manager(trace, KVCacheManager(n, BS, specs=specs), BlockHasher(BS), 4).hit_rate
        uni = replay_manager(trace, KVCacheManager(n // 6, BS), BlockHasher(BS), 4).hit_rate
        print(f"{n} group blocks: hybrid {hyb:.4f}, uniform ({n // 6} blocks) {uni:.4f}")
        rows.append(dict(group_blocks=n, hybrid_hit_rate=hyb, uniform_hit_rate=uni))
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks-hybrid", type=int, nargs="+", default=[1024, 5461])
    ap.add_argument("--blocks-uniform", type=int, nargs="+", default=[170, 910])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--trace", default=None, help="replay this trace through the manager instead")
    a = ap.parse_args()
    if a.trace:
        replay_trace(a.trace, a.blocks_hybrid)
        return
    prompts = generated_shared_prefix(a.groups, 1024, a.questions, 64, seed=0)
    rows = []
    for nh, nu in zip(a.blocks_hybrid, a.blocks_uniform, strict=True):
        h, u = replay(True, nh, prompts, a.output_len), replay(False, nu, prompts, a.output_len)
        print(f"hybrid {nh:5d} blocks: {h}\nuniform {nu:4d} blocks: {u}")
        rows.append(dict(blocks_hybrid=nh, blocks_uniform=nu, hybrid=h, uniform=u))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
