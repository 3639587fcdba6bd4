"""Host-tier blocks through the store and back: the bytes that come back are the ones that went in, in
another process's tensors (a restarted replica), and only under the same fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.store import BlockStore, open_store
from kvpool.store.blocks import block_nbytes, fingerprint, gather, layout, scatter


def host_caches(n_blocks: int, dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, n_blocks, 16, 8)  # kv_heads, blocks, block_size, head_dim
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_survive_a_restart_through_the_store(tmp_path: Path, tiny_llama_dir: Path, dtype: torch.dtype
                                                    ) -> None:
    src = host_caches(6, dtype, seed=0)
    fp = fingerprint(tiny_llama_dir, src, block_size=16)
    payloads = gather(src, [4, 1])
    assert [len(p) for p in payloads] == [block_nbytes(src)] * 2
    src[0][0][:, 4] = 0  # the host block is reused after the gather: the payload must not change
    store = BlockStore(open_store(f"file://{tmp_path}"), fp)
    store.put([(b"h4", payloads[0]), (b"h1", payloads[1])])
    # A new process: empty host tensors of the same layout, the same model.
    dst = host_caches(6, dtype, seed=1)
    got = BlockStore(open_store(f"file://{tmp_path}"), fingerprint(tiny_llama_dir, dst, 16)).get([b"h1", b"h4"])
    assert all(p is not None for p in got)
    scatter(dst, [0, 5], got)  # type: ignore[arg-type]
    ref = host_caches(6, dtype, seed=0)
    for (sk, sv), (dk, dv) in zip(ref, dst, strict=True):
        assert torch.equal(dk[:, 0], sk[:, 1]) and torch.equal(dv[:, 0], sv[:, 1])
        assert torch.equal(dk[:, 5], sk[:, 4]) and torch.equal(dv[:, 5], sv[:, 4])


def test_other_layout_gets_another_fingerprint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    a = host_caches(2, torch.float32, 0)
    b = host_caches(2, torch.bfloat16, 0)
    assert layout(a) != layout(b)
    assert fingerprint(tiny_llama_dir, a, 16).digest != fingerprint(tiny_llama_dir, b, 16).digest
    # Same shapes, elements ordered for the bf16 kernels: a replica running them never shares blocks with
    # one that does not (an AVX2-only machine reading packed bytes would compute garbage).
    assert (fingerprint(tiny_llama_dir, b, 16, kv_layout="packed16").digest
            != fingerprint(tiny_llama_dir, b, 16).digest)
    other_model = tmp_path / "m"
    other_model.mkdir()
    (other_model / "config.json").write_text("{}")
    assert fingerprint(other_model, a, 16).digest != fingerprint(tiny_llama_dir, a, 16).digest
    with pytest.raises(ValueError, match="payload"):
        scatter(a, [0], [b"short"])
