"""Engine configuration, in sections (cache, scheduler, runner), and parsing of human-written sizes such as
'1GiB'.

A section's fields define the `kvpool` command line's engine flags too (their names, defaults and help), see
`kvpool.flags`: a field made with `option(...)` is a flag, a plain field is not.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from kvpool.flags import add_flags, option, values

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(value: str | int | float, field: str = "kv_cache_memory", zero_ok: bool = False) -> int:
    """Bytes from '2GiB', '512MiB', '1e9', 1073741824; a bare number below 1024 means GiB. A zero size is
    refused (for the KV cache it is a mistake) unless `zero_ok` (a tier that zero turns off)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            num, unit = float(value), ""
        except OverflowError:  # (an int past float's range)
            raise ValueError(f"{field}: must be a finite size > 0, got {value!r}") from None
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{field}: cannot read {value!r} as a size (examples: 2GiB, 512MiB, 1073741824)")
        num, unit = float(m.group(1)), m.group(2).lower()
    if zero_ok and num == 0:
        return 0
    if not math.isfinite(num) or num <= 0:
        raise ValueError(f"{field}: must be a finite size > 0, got {value!r}")
    if unit == "" and num < 1024:
        return int(num * (1 << 30))
    return int(num * _UNITS[unit])


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
# The tiers below the device pool, and what acts on cached blocks: an engine built without the one (a bench's
# baseline system, with no host tier or no caching) is built without these options, which it would refuse.
HOST_TIER_OPTIONS = ("swap_space", "num_host_blocks", "kv_store", "write_through", "host_eviction")
CACHING_OPTIONS = (*HOST_TIER_OPTIONS, "eviction_policy", "hash_seed", "pin_budget", "prompt_rows_cache")


def without(kw: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """Engine keywords less `names`."""
    return {k: v for k, v in kw.items() if k not in names}


def _eviction_policies() -> list[str]:
    from kvpool.core.eviction import policy_names

    return policy_names()


def _host_policies() -> list[str]:
    from kvpool.core.host_pool import host_policy_names

    return host_policy_names()


@dataclass
class CacheConfig:
    """The KV cache: its blocks, prefix caching, the host and store tiers, eviction, pins."""

    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_memory: int | str = option("1GiB", "KV cache size: e.g. 2GiB, 512MiB; a bare number is bytes from "
                                        "1024 up, GiB below it (as vLLM's --swap-space)")
    # The dtype the KV cache (device, host and store tiers) holds keys and values in; auto: the model's.
    kv_cache_dtype: str = option("auto", "KV cache dtype; auto: the model's (--dtype). bfloat16 or float16 "
                                 "under a float32 model hold twice the blocks in the same memory, fp8 (e4m3) and "
                                 "fp8_e5m2 four times, and outputs then follow the rounded keys and values",
                                 choices=KV_CACHE_DTYPES)
    num_blocks: int | None = None  # overrides kv_cache_memory (tests)
    enable_prefix_caching: bool = option(True, "disable automatic prefix caching", flag="--no-prefix-caching")
    hash_algo: str = option("sha256", "block hash function", choices=("sha256", "xxh3_128"))
    hash_seed: str | None = option(None, "secret mixed into every block hash (the first parent), so hashes cannot "
                                   "be guessed from prompts; replicas behind one router and a shared store all "
                                   "need the same one (kvpool router --hash-seed)")
    enable_kv_events: bool = False
    swap_space: int | str | float = option(0, "host KV tier size: e.g. 4GiB; a bare number is bytes from 1024 up, "
                                           "GiB below it (as vLLM's); 0 disables it", type=str)
    num_host_blocks: int | None = None  # overrides swap_space (tests)
    host_eviction: str = option("lru", "host tier eviction policy", choices=_host_policies)
    eviction_policy: str = option("lru", "device tier eviction policy (see kvpool bench policy)",
                                  choices=_eviction_policies)
    pin_budget: float = option(0.2, "fraction of the device pool that pinned prefixes may hold (a pin over it "
                               "is refused)")
    write_through: bool = option(False, "copy every newly full block to the host tier, not only when evicted")
    # The store tier below the host tier: file:///dir or redis://host:port (kvpool.store); None: off.
    kv_store: str | None = option(None, "store tier below the host tier: file:///dir or redis://host:port "
                                  "(needs --swap-space)", metavar="URL")
    kv_store_deadline_s: float = option(2.0, "seconds a request waits for its store reads before computing the "
                                        "blocks itself", flag="--kv-store-deadline")
    # State models (Mamba / short-conv layers): keep the state at every this many prompt tokens (a
    # multiple of block_size; 0: only at the prompt's end and hit points), at most this many per request.
    state_retention_tokens: int = option(512, "state models: keep the state every this many prompt tokens "
                                         "(0: only at the end)")
    state_retention_budget: int = 8
    # False: every layer in one full-attention group (the uniform allocator), for comparisons.
    hybrid_allocator: bool = option(True, "keep every layer's blocks as full attention does (the uniform "
                                    "allocator, to compare)", flag="--no-hybrid-allocator")
    encoder_cache_size: int | str = "256MiB"
    # Prompt positions' last hidden states by block hash (kvpool.runner.prompt_rows), written by requests that
    # ask for prompt_logprobs, so that the next such request over the same prefix takes a prefix hit.
    prompt_rows_cache: int | str = option("64MiB", "host memory for the last hidden states of prompts scored with "
                                          "prompt_logprobs, so that later ones over the same prefix hit the cache "
                                          "(0: such a request computes its prompt whole, as vLLM's)", type=str)

@dataclass
class SchedulerConfig:
    """Continuous batching: the step's token budget, its sequences, chunked prefill, the context."""

    # None: the default of the use. Offline (`LLM`, `kvpool generate`, the benchmarks) throughput counts and a
    # longer prefill chunk runs the linear layers faster (a prefill-heavy batch ~5% faster at 4096 than at
    # 2048); serving (`kvpool serve`) keeps decode steps short for inter-token latency. The same split, and
    # the same numbers, as vLLM's CPU defaults (its LLM class 4096, its API server 2048).
    max_num_batched_tokens: int | None = option(None, "token budget of one step (default: 4096 offline, "
                                                      "2048 for kvpool serve)", type=int)
    max_num_seqs: int = option(64, "sequences in one step at most")
    enable_chunked_prefill: bool = True
    max_model_len: int | None = option(None, "longest request, prompt and output (default: the model's, "
                                       "capped by what the KV cache holds; above the model's, an error)", type=int)


@dataclass
class RunnerConfig:
    """The model and how it runs: weights, dtype, device, kernels, per-token outputs, images."""

    model: str | None = option(None, "local Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    dtype: str = option("auto", "weights' (and KV cache's) dtype; auto: bfloat16 where the hardware multiplies it "
                        "natively (AVX-512 BF16, AMX, Arm BF16, CUDA), float32 elsewhere",
                        choices=("auto", "bfloat16", "float32", "float16"))
    device: str | None = option(None, "cpu or cuda (default: cuda when present)")
    skip_tokenizer_init: bool = False
    chat_template: str | None = option(None, "a chat template (its file, or its text) in place of the model's: "
                                       "for a model without one, as Gemma-3 270M's GGUF")
    generation_config: str = option("auto", "sampling defaults (temperature, top_p, top_k) for requests that do "
                                    "not set them: auto, the model's generation_config.json (as vLLM); vllm, "
                                    "kvpool's own (temperature 1, no top-p or top-k)", choices=("auto", "vllm"))
    # Omni stages: collect per-token outputs (final hidden states, plus the residual stream after each of
    # `stage_output_layers`) for every request; cached beside the KV blocks when prefix caching is on.
    stage_outputs: bool = False
    stage_output_layers: tuple[int, ...] = ()
    vision_encoder: Any = None  # an nn.Module mapping images to embeddings (see kvpool.runner.vision)
    # Results independent of batching, chunking and prefix hits, bit for bit (slower attention).
    batch_invariant: bool = False
    # kvpool's compiled CPU kernels (kvpool.runner.kernels) when they build here; False keeps to torch ops.
    native_kernels: bool = option(True, "torch ops only: none of kvpool's compiled CPU kernels (decode and "
                                  "prefill attention, fused norm, rotary and SiLU; also KVPOOL_KERNELS=0)",
                                  flag="--no-native-kernels")
    # LoRA adapters (kvpool.runner.lora): requests name one with a LoRARequest; at most `max_loras`
    # distinct adapters run at once, each of rank <= `max_lora_rank` (smaller ones are zero-padded to it).
    enable_lora: bool = option(False, "accept LoRA adapters (kvpool serve turns it on with --lora-modules)")
    max_loras: int = option(1, "distinct LoRA adapters in one step")
    max_lora_rank: int = option(16, "the largest LoRA rank an adapter may have")
    # Adapters whose weights stay in host memory (vLLM's max_cpu_loras): past it the least recently used
    # one that no request in flight needs is unloaded, and read from its folder again when asked for.
    max_cpu_loras: int | None = option(None, "LoRA adapters kept loaded (the least recently used idle one "
                                       "unloaded past it, reloaded from its folder when asked for; >= "
                                       "max_loras; default: every adapter seen)")


OFFLINE_MAX_NUM_BATCHED_TOKENS = 4096  # LLM(...): see SchedulerConfig.max_num_batched_tokens
SERVING_MAX_NUM_BATCHED_TOKENS = 2048  # an engine built directly (kvpool serve)

SECTIONS: dict[str, type] = {"runner": RunnerConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
_SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}
_BOOL_OPTIONS = [f.name for cls in SECTIONS.values() for f in fields(cls) if f.type == "bool"]


class EngineConfig:
    """The engine's configuration: `cache`, `scheduler` and `runner` sections.

    Built from sections, or from flat keywords (`EngineConfig(block_size=4, dtype="float32")`, as `LLM(...)`
    passes them), each routed to its section; flat reads (`config.block_size`) reach the same fields.
    """

    cache: CacheConfig
    scheduler: SchedulerConfig
    runner: RunnerConfig

    def __init__(self, *, cache: CacheConfig | None = None, scheduler: SchedulerConfig | None = None,
                 runner: RunnerConfig | None = None, **flat: Any) -> None:
        object.__setattr__(self, "cache", cache if cache is not None else CacheConfig())
        object.__setattr__(self, "scheduler", scheduler if scheduler is not None else SchedulerConfig())
        object.__setattr__(self, "runner", runner if runner is not None else RunnerConfig())
        for name, value in flat.items():
            if name not in _SECTION_OF:
                raise TypeError(f"EngineConfig: unknown option {name!r}")
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:  # only for names not found on the object: the sections' fields
        section = _SECTION_OF.get(name)
        if section is None:
            raise AttributeError(f"EngineConfig has no option {name!r}")
        return getattr(self.__dict__[section], name)

    def __setattr__(self, name: str, value: Any) -> None:
        section = _SECTION_OF.get(name)
        if section is None:
            object.__setattr__(self, name, value)
        else:
            setattr(self.__dict__[section], name, value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineConfig) and all(
            getattr(self, s) == getattr(other, s) for s in SECTIONS)

    def __repr__(self) -> str:
        return f"EngineConfig(cache={self.cache!r}, scheduler={self.scheduler!r}, runner={self.runner!r})"

    @staticmethod
    def add_cli_flags(p: argparse.ArgumentParser) -> None:
        """The engine's flags, one argument group per section."""
        for name, cls in SECTIONS.items():
            add_flags(p, cls, f"engine ({name})")

    @staticmethod
    def cli_values(args: argparse.Namespace) -> dict[str, Any]:
        """The engine's flags as parsed: flat keyword arguments for `EngineConfig` / `LLM`."""
        out: dict[str, Any] = {}
        for cls in SECTIONS.values():
            out.update(values(cls, args))
        return out

    def validate(self) -> None:
        """A ValueError naming the option for a value out of range or of the wrong type (the engine calls
        it before loading anything, so a bad option never surfaces as another option's error or a torch
        exception)."""

        def count(name: str, least: int, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name}: must be an int >= {least}{' or None' if optional else ''}, got {v!r}")

        count("block_size", 1)
        count("num_blocks", 2, optional=True)
        count("num_host_blocks", 0, optional=True)
        count("max_model_len", 2, optional=True)
        count("max_num_seqs", 1)
        count("max_num_batched_tokens", 1, optional=True)
        count("state_retention_tokens", 0)
        count("max_loras", 1)  # (checked here even without enable_lora: a bool passes the runner's int check)
        count("max_lora_rank", 1)
        count("max_cpu_loras", 1, optional=True)
        if self.max_cpu_loras is not None:
            if not self.enable_lora:
                raise ValueError("max_cpu_loras: bounds the LoRA adapters kept loaded, and LoRA is off "
                                 "(set enable_lora)")
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}")
        if self.chat_template is not None:
            if self.skip_tokenizer_init:
                raise ValueError("chat_template: renders chats with the tokenizer, and skip_tokenizer_init=True "
                                 "loads none")
            from kvpool.engine.chat_template import load_chat_template

            load_chat_template(self.chat_template)  # (a path mistyped: refused before the model loads)
        if self.model is not None and (not isinstance(self.model, str | os.PathLike) or not os.fspath(self.model)):
            raise ValueError(f"model: must be a model folder (a path) or None, got {self.model!r}")
        d = self.kv_store_deadline_s
        # (NaN compares false to everything: a `<= 0` check lets it through, and a NaN deadline never fires)
        if isinstance(d, bool) or not isinstance(d, int | float) or not (math.isfinite(d) and d > 0):
            raise ValueError(f"kv_store_deadline: must be > 0 seconds, got {d!r}")
        self.kv_cache_bytes()
        host = self.num_host_blocks > 0 if self.num_host_blocks is not None else self.swap_space_bytes() > 0
        if self.host_eviction not in _host_policies():
            raise ValueError(f"host_eviction: unknown policy {self.host_eviction!r}; one of "
                             f"{', '.join(_host_policies())}")
        # Host tier options without a host tier would be ignored, silently: the user meant to have one.
        if not host and self.write_through:
            raise ValueError("write_through: copies blocks to the host tier, and there is none (set swap_space)")
        if not host and self.host_eviction != "lru":
            raise ValueError(f"host_eviction: {self.host_eviction!r} orders the host tier, and there is none (set "
                             f"swap_space)")
        parse_size(self.encoder_cache_size, "encoder_cache_size")
        self.prompt_rows_bytes()
        count("state_retention_budget", 0)
        layers = self.stage_output_layers
        if not isinstance(layers, tuple | list) or any(isinstance(x, bool) or not isinstance(x, int) for x in layers):
            raise ValueError(f"stage_output_layers: a sequence of layer indices, got {layers!r}")
        b = self.pin_budget
        if isinstance(b, bool) or not isinstance(b, int | float) or not 0 <= b <= 1:
            raise ValueError(f"pin_budget: a fraction of the pool in [0, 1], got {b!r}")
        if self.device is not None and not (isinstance(self.device, str) and self.device.strip()):
            # (an empty name would silently mean the default device; None is the way to ask for that)
            raise ValueError(f"device: must be a string such as 'cpu' or 'cuda', or None, got {self.device!r}")
        for name in _BOOL_OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        from kvpool.core.hashing import check_hash_seed, resolve_hash_algo

        resolve_hash_algo(self.hash_algo)  # (checked with caching off too: the flag was given for a reason)
        check_hash_seed(self.hash_seed)
        if self.kv_store is not None:
            if not isinstance(self.kv_store, str) or not self.kv_store.strip():
                # (an empty value, as an unset shell variable gives, silently meant no store)
                raise ValueError(f"kv_store: a store URL (file:///dir or redis://host:port), got {self.kv_store!r}")
            from kvpool.store import check_store_url

            check_store_url(self.kv_store)
            if not host:
                raise ValueError("kv_store: the store tier lies below the host tier, and there is none (set "
                                 "swap_space)")
        # Options of prefix caching with it off would be ignored, silently: the user meant to have it.
        if not self.enable_prefix_caching:
            for name in ("eviction_policy", "hash_seed", "pin_budget"):
                if getattr(self, name) != getattr(CacheConfig, name):  # (its default: what "not set" reads as)
                    raise ValueError(f"{name}: applies to cached blocks, and prefix caching is off "
                                     f"(enable_prefix_caching=False, --no-prefix-caching)")
        if not self.enable_lora:
            for name in ("max_loras", "max_lora_rank"):
                if getattr(self, name) != getattr(RunnerConfig, name):
                    raise ValueError(f"{name}: bounds LoRA adapters, and LoRA is off (set enable_lora)")
        if self.kv_store and self.stage_outputs:
            # A block read from the store brings its K/V, not the stage outputs of its tokens: the prefix's
            # hidden states would come back empty.
            raise ValueError("kv_store: the store tier does not keep stage outputs; a prefix read from it would "
                             "have none. Use kv_store or stage_outputs, not both")

    def swap_space_bytes(self) -> int:
        if self.swap_space is None:
            return 0
        # Any zero disables the tier ("0", 0.0, "0GiB"), as the flag's help says.
        return parse_size(self.swap_space, "swap_space", zero_ok=True)

    def prompt_rows_bytes(self) -> int:
        """The prompt-row cache's bytes (0: none)."""
        return parse_size(self.prompt_rows_cache, "prompt_rows_cache", zero_ok=True)

    def kv_cache_bytes(self) -> int:
        return parse_size(self.kv_cache_memory)
