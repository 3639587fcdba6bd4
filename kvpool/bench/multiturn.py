"""`kvpool bench multiturn`: multi-turn chats on the real model with a device pool smaller than the
working set, five cache configurations in one run.

C conversations of T turns, interleaved in a random order (the shape of `make_trace.py multi-turn`)
with at most `--concurrency` requests in flight; each turn's prompt is the whole history (a shared
system prompt, earlier user messages and answers) plus a new user message, and a turn is sent only
once the same conversation's previous turn has finished. The device pool holds the running requests
but not every conversation's history: what falls out of it is what the host tier can shelter.
Answers appended to the history are the trace's, not the
model's, so every configuration sees identical prompts; the model still generates as many tokens.
Systems: no prefix caching; device-only caching; device + host tier (lazy swap-out); device + host
(write-through); device-only with a pool large enough for everything (the ceiling). A system named
`NAME@POLICY` (e.g. `device@reuse`) runs with that device eviction policy, so policies compare in one run;
`NAME:KV_DTYPE` (e.g. `device:bfloat16`, `no-cache:bfloat16`) keeps its KV cache in that dtype, in the same
memory as NAME (a bf16 cache under an fp32 model: twice the blocks), and its outputs are compared with
`no-cache` of the same KV dtype.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from kvpool.bench.plots import plot_path, ttft_per_turn
from kvpool.bench.report import emit, format_table, name_list, percentile
from kvpool.server.options import _positive, at_least

SYSTEMS = ("no-cache", "device", "device+host", "device+host-write-through", "unlimited")


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Checked as parsed: a 0 would otherwise end in the mean of no TTFTs, after the model loaded.
    p.add_argument("--conversations", type=_positive, default=16)
    p.add_argument("--turns", type=_positive, default=4)
    p.add_argument("--concurrency", type=_positive, default=4, help="requests in flight")
    p.add_argument("--system-len", type=at_least(0), default=256)
    p.add_argument("--user-len", type=span_flag, default="32:96", help="min:max tokens of a user message")
    p.add_argument("--answer-len", type=span_flag, default="16:32", help="min:max tokens of an answer")
    p.add_argument("--device-blocks", type=at_least(2), default=192, help="device pool of the limited systems")
    p.add_argument("--host-blocks", type=_positive, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated, each NAME or NAME:KV_DTYPE, NAME one of " + ", ".join(SYSTEMS))
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="TTFT per turn, one line per system")


def _span(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    return int(lo), int(hi or lo)


def span_flag(text: str) -> str:
    """argparse type of a MIN:MAX length flag: checked as parsed, kept as text (the result reports it so)."""
    try:
        lo, hi = _span(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be MIN:MAX (or N) token counts, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return text


def conversations(a: argparse.Namespace, vocab: tuple[int, int] = (1000, 40000)) -> tuple[list[int], list[list[tuple]]]:
    rng = random.Random(a.seed)
    ulo, uhi = _span(a.user_len)
    alo, ahi = _span(a.answer_len)
    system = [rng.randrange(*vocab) for _ in range(a.system_len)]
    convs = [[([rng.randrange(*vocab) for _ in range(rng.randint(ulo, uhi))],
               [rng.randrange(*vocab) for _ in range(rng.randint(alo, ahi))]) for _ in range(a.turns)]
             for _ in range(a.conversations)]
    return system, convs


def arrival_order(a: argparse.Namespace) -> list[int]:
    """Conversation ids, one per turn, shuffled: the k-th occurrence of c is c's turn k."""
    order = [c for c in range(a.conversations) for _ in range(a.turns)]
    random.Random(a.seed + 1).shuffle(order)
    return order


def take_idle(order: list[int], busy: set[int], limit: int) -> list[int]:
    """The earliest pending turns (taken out of `order`) whose conversation is idle, until `busy` holds
    `limit` conversations; they are marked busy."""
    taken = []
    i = 0
    while i < len(order) and len(busy) < limit:
        c = order[i]
        if c in busy:
            i += 1
            continue
        order.pop(i)
        busy.add(c)
        taken.append(c)
    return taken


def run_system(name: str, a: argparse.Namespace, engine_kw: dict[str, Any]) -> tuple[dict, list[list[int]]]:
    from kvpool.engine.config import CACHING_OPTIONS, HOST_TIER_OPTIONS, without
    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling_params import SamplingParams

    system, convs = conversations(a)
    kw = dict(engine_kw)
    name, _, kv_dtype = name.partition(":")
    if kv_dtype:
        kw["kv_cache_dtype"] = kv_dtype
    name, _, policy = name.partition("@")
    if policy:
        kw["eviction_policy"] = policy
    kw["enable_prefix_caching"] = name != "no-cache"
    # No-cache keeps nothing; the systems without a host tier get none of its options (--kv-store,
    # --host-eviction: the device+host systems').
    kw = without(kw, CACHING_OPTIONS if name == "no-cache" else () if name.startswith("device+host")
                 else HOST_TIER_OPTIONS)
    working_set = sum(-(-(a.system_len + sum(len(u) + len(ans) for u, ans in c)) // kw.get("block_size", 16))
                      for c in convs)
    # The ceiling (and no-cache, which needs no room to keep anything) get room for the whole working set.
    roomy = name in ("unlimited", "no-cache")
    kw["num_blocks"] = max(2 * working_set, a.device_blocks) if roomy else a.device_blocks
    if name.startswith("device+host"):
        kw["num_host_blocks"] = a.host_blocks
        kw["write_through"] = name.endswith("write-through")
    llm = LLM(**kw)
    eng = llm.engine
    # The working set counts one block per 16 tokens, but on the hybrid allocator every group takes its own
    # block ids from the one pool: the ceiling needs room for each group to keep everything. And a KV dtype
    # narrower than the model's holds proportionally more blocks (and host blocks) in the same memory.
    scale = eng.kv.num_groups if roomy else 1
    if kv_dtype and not roomy:
        scale = eng.runner.dtype.itemsize // eng.runner.kv_dtype.itemsize or 1
    if scale > 1:
        kw["num_blocks"] *= scale
        if "num_host_blocks" in kw:
            kw["num_host_blocks"] *= scale
        del llm, eng
        llm = LLM(**kw)
        eng = llm.engine
    history = [list(system) for _ in convs]
    turn = [0] * len(convs)
    sent: dict[str, tuple[int, int, float]] = {}
    ttft: dict[int, list[float]] = {}
    outputs: list[list[int]] = [[] for _ in convs]

    def send(c: int) -> None:
        user, ans = convs[c][turn[c]]
        history[c] += user
        req = eng.add_request(list(history[c]), SamplingParams(temperature=0.0, max_tokens=len(ans), ignore_eos=True),
                              request_id=f"c{c}-t{turn[c]}")
        sent[req.request_id] = (c, turn[c], time.perf_counter())

    order = arrival_order(a)
    busy: set[int] = set()

    def refill() -> None:
        for c in take_idle(order, busy, a.concurrency):
            send(c)

    t0 = time.perf_counter()
    refill()
    n_out = n_prompt = n_cached = n_host = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            c, t, at = sent[out.request_id]
            if len(out.token_ids) == 1:  # the step that produced the first token
                ttft.setdefault(t, []).append(time.perf_counter() - at)
            if not out.finished:
                continue
            outputs[c] += out.token_ids
            n_out += len(out.token_ids)
            n_prompt += len(out.prompt_token_ids)
            n_cached += out.num_cached_tokens
            n_host += out.metrics.num_host_cached_tokens if out.metrics is not None else 0
            history[c] += convs[c][t][1]
            turn[c] += 1
            busy.discard(c)
        refill()
    wall = time.perf_counter() - t0
    st = eng.kv.stats
    later = [x for t, xs in ttft.items() if t > 0 for x in xs]
    res = dict(wall_s=wall, output_tokens_per_s=n_out / wall, total_tokens_per_s=(n_out + n_prompt) / wall,
               ttft_mean_ms=1e3 * statistics.mean(x for xs in ttft.values() for x in xs),
               ttft_mean_ms_later_turns=1e3 * statistics.mean(later) if later else 0.0,
               ttft_p99_ms=1e3 * percentile([x for xs in ttft.values() for x in xs], 99),
               ttft_mean_ms_by_turn={t: 1e3 * statistics.mean(xs) for t, xs in sorted(ttft.items())},
               # What each request saw at its first admission; lookup_hit_rate is the manager's counters
               # (vLLM's prefix_cache_queries/hits, a preempted request's admissions again counted apart)
               hit_rate=n_cached / n_prompt if n_prompt else 0.0, lookup_hit_rate=st.hit_rate,
               host_hit_rate=n_host / n_prompt if n_prompt else 0.0,
               device_blocks=kw["num_blocks"], blocks_swapped_out=eng.kv.swap_stats.blocks_out,
               blocks_swapped_in=eng.kv.swap_stats.blocks_in,
               bytes_copied=(eng.kv.swap_stats.blocks_out + eng.kv.swap_stats.blocks_in) * eng.runner.bytes_per_block,
               swap_seconds=eng.runner.swap_seconds, preemptions=eng.scheduler.stats.num_preemptions)
    return res, outputs


def run(a: argparse.Namespace, engine_kw: dict[str, Any]) -> dict:
    plot_path(a.plot)
    # The systems set caching and the host tier themselves: these flags would be overridden, or would give the
    # device-only systems (the baselines) a host tier.
    from kvpool.core.eviction import policy_names
    from kvpool.engine.config import KV_CACHE_DTYPES, CacheConfig, parse_size

    if engine_kw.get("enable_prefix_caching") is False:
        raise ValueError("--no-prefix-caching: not a bench multiturn flag; run --systems no-cache")
    if parse_size(engine_kw.get("swap_space") or 0, "swap_space", zero_ok=True):
        raise ValueError("--swap-space: not a bench multiturn flag; the device+host systems take --host-blocks")
    if engine_kw.get("write_through"):
        raise ValueError("--write-through: not a bench multiturn flag; run --systems device+host-write-through")
    kv_memory = engine_kw.get("kv_cache_memory", CacheConfig.kv_cache_memory)
    if kv_memory != CacheConfig.kv_cache_memory:  # (every system sets its pool in blocks)
        raise ValueError("--kv-cache-memory: not a bench multiturn flag; the systems' device pools take "
                         "--device-blocks (the host tier's --host-blocks)")
    # Every name (and policy) is checked before the first system runs (each takes minutes).
    names = name_list("systems", a.systems, SYSTEMS, key=lambda n: n.partition(":")[0].partition("@")[0])
    for n in names:
        base, _, kv_dtype = n.partition(":")
        policy = base.partition("@")[2]
        if "@" in base and policy not in policy_names():
            raise ValueError(f"systems: {n!r}: unknown eviction policy {policy!r} (one of {', '.join(policy_names())})")
        if "@" in base and base.startswith("no-cache"):
            raise ValueError(f"systems: {n!r}: no-cache keeps no blocks to evict; no policy applies")
        if ":" in n and kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"systems: {n!r}: unknown KV cache dtype {kv_dtype!r} (one of "
                             f"{', '.join(KV_CACHE_DTYPES)})")
    systems: dict[str, dict] = {}
    outs: dict[str, list[list[int]]] = {}
    for n in names:
        systems[n], outs[n] = run_system(n, a, engine_kw)
    for n in names:
        kv_dtype = n.partition(":")[2]
        base = outs.get(f"no-cache:{kv_dtype}" if kv_dtype else "no-cache")
        same = [x == y for x, y in zip(outs[n], base, strict=True)] if base is not None else []
        systems[n]["outputs_identical"] = all(same) if base is not None else None
        systems[n]["outputs_identical_fraction"] = sum(same) / len(same) if same else None
    result: dict[str, Any] = dict(workload=dict(conversations=a.conversations, turns=a.turns,
                                                concurrency=a.concurrency, system_len=a.system_len,
                                                user_len=a.user_len, answer_len=a.answer_len,
                                                device_blocks=a.device_blocks, host_blocks=a.host_blocks),
                                  systems=systems)
    if "device+host" in systems and "unlimited" in systems and "device" in systems:
        dh, un, dv = systems["device+host"], systems["unlimited"], systems["device"]
        result["device_host_vs_unlimited_ttft"] = dh["ttft_mean_ms"] / un["ttft_mean_ms"]
        later = dh["ttft_mean_ms_later_turns"]
        result["device_vs_device_host_ttft_later_turns"] = dv["ttft_mean_ms_later_turns"] / later
    rows = [[n, f"{s['wall_s']:.1f}", f"{s['ttft_mean_ms']:.0f}", f"{s['ttft_mean_ms_later_turns']:.0f}",
             f"{s['hit_rate']:.3f}", f"{s['host_hit_rate']:.3f}", f"{s['bytes_copied'] / 2**20:.1f}",
             f"{s['swap_seconds']:.3f}",
             s["preemptions"],
             "-" if s["outputs_identical_fraction"] is None else f"{s['outputs_identical_fraction']:.2f}"]
            for n, s in systems.items()]
    table = format_table(["system", "wall s", "TTFT ms", "TTFT later turns", "hit", "host hit", "MiB copied",
                          "copy s", "preempt", "same as no-cache"], rows)
    by_turn = "\n".join(
        f"{n}: TTFT ms by turn " + ", ".join(f"{t}: {v:.0f}" for t, v in s["ttft_mean_ms_by_turn"].items())
        for n, s in systems.items())
    if a.plot:
        ttft_per_turn(a.plot, systems)
        by_turn += f"\nplot: {a.plot}"
    emit(table + "\n" + by_turn, result, a.json)
    return result
