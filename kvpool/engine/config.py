"""Engine configuration, and parsing of human-written sizes such as '1GiB'."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_size(value: str | int | float, field: str = "kv_cache_memory") -> int:
    """Bytes from '2GiB', '512MiB', '1e9', 1073741824; a bare number below 1024 means GiB."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        num, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{field}: cannot read {value!r} as a size (examples: 2GiB, 512MiB, 1073741824)")
        num, unit = float(m.group(1)), m.group(2).lower()
    if num <= 0:
        raise ValueError(f"{field}: must be > 0, got {value!r}")
    if unit == "" and num < 1024:
        return int(num * (1 << 30))
    return int(num * _UNITS[unit])


@dataclass
class EngineConfig:
    model: str | None = None  # a local HF folder; None: the default SmolLM2
    dtype: str = "bfloat16"
    device: str | None = None  # None: cuda when present, else cpu
    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"
    num_blocks: int | None = None  # overrides kv_cache_memory (tests)
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    skip_tokenizer_init: bool = False
    enable_kv_events: bool = False
    swap_space: int | str | float = 0  # host KV tier size (bytes, or e.g. '4GiB'); 0 disables it
    num_host_blocks: int | None = None  # overrides swap_space (tests)
    host_eviction: str = "lru"  # lru | arc | any device policy (kvpool.core.policies)
    eviction_policy: str = "lru"  # the device tier's: lru | slru | prefix | reuse (kvpool.core.policies)
    pin_budget: float = 0.2  # fraction of the device pool that pinned prefixes may hold
    write_through: bool = False  # copy every newly full block to the host tier, not only on eviction
    # The store tier below the host tier: file:///dir or redis://host:port (kvpool.store); None: off.
    kv_store: str | None = None
    kv_store_deadline_s: float = 2.0  # a request waits at most this long for its store reads
    # State models (Mamba / short-conv layers): keep the state at every this many prompt tokens (a
    # multiple of block_size; 0: only at the prompt's end and hit points), at most this many per request.
    state_retention_tokens: int = 512
    state_retention_budget: int = 8
    # False: every layer in one full-attention group (the uniform allocator), for comparisons.
    hybrid_allocator: bool = True
    # Omni stages: collect per-token outputs (final hidden states, plus the residual stream after each of
    # `stage_output_layers`) for every request; cached beside the KV blocks when prefix caching is on.
    stage_outputs: bool = False
    stage_output_layers: tuple[int, ...] = ()
    vision_encoder: Any = None  # an nn.Module mapping images to embeddings (see kvpool.runner.vision)
    encoder_cache_size: int | str = "256MiB"
    # Results independent of batching, chunking and prefix hits, bit for bit (slower attention).
    batch_invariant: bool = False
    # Decode attention through kvpool's compiled CPU kernel (kvpool.runner.kernels) when it builds here;
    # False keeps to torch ops (also: KVPOOL_KERNELS=0).
    native_kernels: bool = True
    # LoRA adapters (kvpool.runner.lora): requests name one with a LoRARequest; at most `max_loras`
    # distinct adapters run at once, each of rank <= `max_lora_rank` (smaller ones are zero-padded to it).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def swap_space_bytes(self) -> int:
        if self.swap_space in (0, "0", 0.0, None):
            return 0
        return parse_size(self.swap_space, "swap_space")

    def kv_cache_bytes(self) -> int:
        return parse_size(self.kv_cache_memory)
