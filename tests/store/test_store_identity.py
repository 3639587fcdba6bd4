"""What a store entry is valid for: the model's every weight byte, the dtype it computed in, and for
LoRA blocks the adapter's files. A replica that differs in any of them reads none of another's blocks,
so a shared store never gives wrong tokens (these were the three ways it did)."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_llama

from kvpool.engine.llm import LLM
from kvpool.engine.lora_request import LoRARequest
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner import file_identity
from kvpool.store.base import Fingerprint, model_identity

BS = 4


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """File digests remembered in this test's folder (not kvpool's cache, which holds the built kernels)."""
    monkeypatch.setattr(file_identity, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(file_identity, "_memo", {})


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(41)] for _ in range(2)]


def generate(model: Path, store: str | None, **kw: object) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens and cached prompt tokens of each prompt, with the store at `store` (or none)."""
    args: dict[str, object] = dict(dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=64,
                                   num_host_blocks=64, write_through=True, kv_store=store)
    lora = kw.pop("lora", None)
    args.update(kw)
    llm = LLM(str(model), **args)  # type: ignore[arg-type]
    outs = llm.generate(prompts(), SamplingParams.greedy(6), use_tqdm=False,
                        lora_request=LoRARequest("sql", 1, str(lora)) if lora else None)
    if llm.engine.store is not None:
        llm.engine.store.close()  # (waits for the writes)
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


def fine_tune_one_tensor(src: Path, dst: Path) -> None:
    """A copy of `src` whose k_proj of layer 1 is changed in place: same size, header and tail bytes."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    lo, hi = json.loads(raw[8:8 + n])["model.layers.1.self_attn.k_proj.weight"]["data_offsets"]
    t = torch.frombuffer(bytearray(raw[8 + n + lo:8 + n + hi]), dtype=torch.float32).clone()
    t += 0.5 * torch.randn(t.shape, generator=torch.Generator().manual_seed(0))
    raw[8 + n + lo:8 + n + hi] = t.numpy().tobytes()
    f.write_bytes(bytes(raw))


def test_a_fine_tune_of_one_middle_tensor_reads_none_of_the_original(tmp_path: Path) -> None:
    base = make_tiny_llama(tmp_path / "base", hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    tuned = tmp_path / "tuned"
    fine_tune_one_tensor(base, tuned)
    assert (tuned / "model.safetensors").stat().st_size == (base / "model.safetensors").stat().st_size
    assert model_identity(base) != model_identity(tuned)
    store = f"file://{tmp_path / 'store'}"
    want, _ = generate(base, None)
    generate(tuned, store)  # fills the store with the fine-tune's blocks
    got, cached = generate(base, store)
    assert got == want and cached == [0, 0]
    # ... while the same weights again read them all (every full block but the last prompt token's).
    _, cached = generate(tuned, store)
    assert cached == [40, 40]


def test_file_digests_are_remembered_by_stat_and_see_any_rewrite(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    first = file_identity.file_digest(f)
    assert first == file_identity.xxhash.xxh3_128(b"a" * 1000).hexdigest()

    def unread(*_: object) -> None:
        raise AssertionError("the file was read again")

    monkeypatch.setattr(file_identity, "_memo", {})  # a new process: only the cache on disk
    monkeypatch.setattr(file_identity.xxhash, "xxh3_128", unread)
    assert file_identity.file_digest(f) == first
    monkeypatch.undo()
    monkeypatch.setattr(file_identity, "cache_dir", lambda: tmp_path / "cache")
    # Rewritten in place with the same size and its old modification time put back: the change time moved.
    st = f.stat()
    f.write_bytes(b"a" * 499 + b"b" + b"a" * 500)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_identity.file_digest(f) != first


def test_the_compute_dtype_is_part_of_the_fingerprint() -> None:
    a = Fingerprint(model="m", dtype="bfloat16", block_size=16, compute="float32")
    b = Fingerprint(model="m", dtype="bfloat16", block_size=16, compute="bfloat16")
    assert a.digest != b.digest and a.key(b"h") != b.key(b"h")


def test_an_adapter_name_reused_for_other_weights_reads_none_of_its_blocks(tmp_path: Path) -> None:
    base = make_tiny_llama(tmp_path / "base")
    v1 = make_peft_adapter(base, tmp_path / "sql-v1", r=8, targets=["k_proj", "v_proj"], seed=1)
    v2 = make_peft_adapter(base, tmp_path / "sql-v2", r=8, targets=["k_proj", "v_proj"], seed=2)
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=16)
    store = f"file://{tmp_path / 'store'}"
    want, _ = generate(base, None, lora=v2, **lora)
    generate(base, store, lora=v1, **lora)  # "sql" is v1 here ...
    got, cached = generate(base, store, lora=v2, **lora)  # ... and v2 on this replica
    assert got == want and cached == [0, 0]
    _, cached = generate(base, store, lora=v1, **lora)
    assert cached == [40, 40]
