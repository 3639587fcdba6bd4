"""The bf16 prompt-attention kernel alone, in GFLOP/s per thread, on SmolLM2's shape (9 heads, 3 kv heads,
head_dim 64, blocks of 16, packed caches): one 1,088-token prompt, 8 x 64 new tokens over a 1,088-token
prefix, and four 1,024-token prompts (a 4,096-token step). FLOPs count the causal pairs only (2 products of
head_dim per pair and head). With one thread it times `time.thread_time` (other load on the machine does not
count), else wall time; medians of 7. Usage: python scripts/prefill_attention_gflops.py [THREADS]"""

from __future__ import annotations

import sys
import time

import torch

from kvpool.runner import kernels

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def case(q_lens: list[int], ctxs: list[int], threads: int) -> tuple[float, float]:
    """(GFLOP/s, ms) of one call over sequences with these query counts and context lengths."""
    widths = [-(-c // BLOCK) for c in ctxs]
    kc = torch.randn(KV_HEADS, sum(widths) + 1, BLOCK, DIM).bfloat16()
    vc = torch.randn_like(kc)
    kc, vc = kernels.packed_layout(kc, vc)
    tables = torch.zeros(len(ctxs), max(widths), dtype=torch.long)
    first = 0
    for i, w in enumerate(widths):
        tables[i, :w] = torch.arange(first, first + w)
        first += w
    q = torch.randn(sum(q_lens), HEADS, DIM).bfloat16()
    out = torch.empty_like(q)
    starts = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens))])
    flop = sum(4 * HEADS * DIM * sum(c - n + j + 1 for j in range(n)) for n, c in zip(q_lens, ctxs, strict=True))
    clock = time.thread_time if threads == 1 else time.perf_counter
    times = []
    for _ in range(8):  # (the first warms up)
        t = clock()
        torch.ops.kvpool.paged_prefill_attention(q, kc, vc, starts, torch.tensor(q_lens), torch.tensor(ctxs), tables,
                                                 0, DIM ** -0.5, out, True)
        times.append(clock() - t)
    median = sorted(times[1:])[3]
    return flop / median / 1e9, median * 1e3


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if kernels.paged_prefill_attention() is None or not kernels.prefill_supported(DIM, BLOCK):
        raise SystemExit("the bf16 prefill kernel does not run on this CPU (it needs AVX-512 BF16)")
    for name, q_lens, ctxs in [("one 1,088-token prompt", [1088], [1088]),
                               ("8 x 64 over a 1,088 prefix", [64] * 8, [1088 + 64 * i for i in range(1, 9)]),
                               ("4 x 1,024-token prompts", [1024] * 4, [1024] * 4)]:
        gflops, ms = case(q_lens, ctxs, threads)
        print(f"{name:28s} {gflops:7.1f} GFLOP/s {ms:8.2f} ms")


if __name__ == "__main__":
    main()
