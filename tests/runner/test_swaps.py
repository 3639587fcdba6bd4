"""The runner's swap execution: content survives a round trip, and swap-outs run before swap-ins."""

from __future__ import annotations

from pathlib import Path

import torch

from kvpool.core.swap import SwapPlan
from kvpool.runner.model_runner import ModelRunner


def runner(model: Path) -> ModelRunner:
    r = ModelRunner(model, dtype="float32", block_size=4, num_blocks=8)
    r.allocate_host_cache(4 * r.bytes_per_block)
    for i, (k, v) in enumerate(r.kv_caches):
        k.copy_(torch.randn_like(k) + i)
        v.copy_(torch.randn_like(v) - i)
    return r


def test_round_trip_restores_the_blocks(tiny_llama_dir: Path) -> None:
    r = runner(tiny_llama_dir)
    assert len(r.host_kv_caches) == len(r.kv_caches) and r.host_kv_caches[0][0].shape[1] == 4
    saved = [(k[:, [3, 5]].clone(), v[:, [3, 5]].clone()) for k, v in r.kv_caches]
    r.execute_swaps(SwapPlan(swap_out=[(3, 2), (5, 0)]))
    for k, v in r.kv_caches:  # the device blocks get new content, as a forward would write
        k[:, [3, 5]] = 0.0
        v[:, [3, 5]] = 0.0
    r.execute_swaps(SwapPlan(swap_in=[(2, 6), (0, 1)]))
    for (k, v), (sk, sv) in zip(r.kv_caches, saved, strict=True):
        torch.testing.assert_close(k[:, [6, 1]], sk, rtol=0, atol=0)
        torch.testing.assert_close(v[:, [6, 1]], sv, rtol=0, atol=0)
    assert (r.num_blocks_swapped_out, r.num_blocks_swapped_in) == (2, 2)


def test_swap_out_and_in_of_one_device_block_in_one_step(tiny_llama_dir: Path) -> None:
    r = runner(tiny_llama_dir)
    # Host block 1 holds content X; device block 4 holds content Y, evicted this very step and the
    # destination of X's swap-in: Y must reach the host before X overwrites block 4.
    r.execute_swaps(SwapPlan(swap_out=[(2, 1)]))
    x = [(k[:, 2].clone(), v[:, 2].clone()) for k, v in r.kv_caches]
    y = [(k[:, 4].clone(), v[:, 4].clone()) for k, v in r.kv_caches]
    r.execute_swaps(SwapPlan(swap_out=[(4, 3)], swap_in=[(1, 4)]))
    for (k, v), (hk, hv), (xk, xv), (yk, yv) in zip(r.kv_caches, r.host_kv_caches, x, y, strict=True):
        torch.testing.assert_close(hk[:, 3], yk.cpu(), rtol=0, atol=0)  # the host tier is on the CPU
        torch.testing.assert_close(hv[:, 3], yv.cpu(), rtol=0, atol=0)
        torch.testing.assert_close(k[:, 4], xk, rtol=0, atol=0)
        torch.testing.assert_close(v[:, 4], xv, rtol=0, atol=0)
