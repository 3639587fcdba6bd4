"""The model runner: owns the model and the paged KV tensors, and executes one engine step.

A step is a list of `SeqStep`s (which tokens of which request to compute, at which positions, into
which blocks). The runner executes the step's swap plan first (see `kvpool.core.swap`), builds the
slot mapping and block tables, runs the forward pass once over every token of the step, and samples
the sequences that reached their last known token.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvpool.core.host_tier import split_host_pages
from kvpool.core.kv_cache_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvpool.core.swap import SwapPlan
from kvpool.runner import kernels
from kvpool.runner.attention import AttentionMetadata, SeqAttn
from kvpool.runner.attention_backends import select_backend
from kvpool.runner.dtypes import indexable, resolve_dtype, resolve_kv_dtype
from kvpool.runner.encoder_cache import EncoderCache
from kvpool.runner.invariant import make_batch_invariant
from kvpool.runner.layer_layout import LayerLayout
from kvpool.runner.lora import LoRAManager
from kvpool.runner.models.llama import LlamaForCausalLM, Rotary, can_pack
from kvpool.runner.models.mllama import CrossAttentionMetadata, CrossStep, plan_cross_attention
from kvpool.runner.models.registry import resolve_model_class
from kvpool.runner.multimodal import InputProcessor, MultiModalProcessor
from kvpool.runner.prompt_rows import PromptLogprobsStep, PromptRowCache
from kvpool.runner.sampler import (
    History,
    SamplingLike,
    TokenLogprobs,
    allowed,
    biases,
    is_greedy,
    sample,
    token_logprobs,
)
from kvpool.runner.stage_output_cache import StageOutputCache
from kvpool.runner.state_cache import PagedBuffers, StateMetadata, large_page_bytes, layer_specs, plan_state

log = logging.getLogger(__name__)

# What a step plans per KV cache group: attention over blocks, cross-attention to an image, or states.
GroupMetadata = AttentionMetadata | CrossAttentionMetadata | StateMetadata


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class _StepPlan:
    """What the group planners of one step read: the step, and per group its slots and sequences."""

    steps: list[Any]  # the step's SeqSteps, in batch order
    spans: list[tuple[int, int, int]]  # per sequence: first row, first position, tokens
    slots: list[torch.Tensor]  # per group: the slot of every token
    seqs: list[list[SeqAttn]]  # per attention group: its sequences
    state_tables: list[list[list[int]]]  # per state group: each sequence's block table
    masks_by_window: dict[int, AttentionMetadata] = field(default_factory=dict)


@dataclass
class SeqStep:
    req_id: str
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0]
    block_ids: list[int]  # the request's block table (of group 0)
    sample: bool  # this chunk ends at the request's last known token: sample the next one
    sampling: SamplingLike | None = None
    generator: torch.Generator | None = None
    # Models with several KV cache groups (sliding-window layers): every group's table, group 0 first.
    group_block_ids: tuple[list[int], ...] | None = None
    # (rows within token_ids, embeddings): inputs replacing those tokens' embeddings (images, stage inputs)
    embeds: tuple[list[int], torch.Tensor] | None = None
    # Cross-attention models: the request's image (its encoder states the first time), see kvpool.runner.models.mllama
    cross: CrossStep | None = None
    lora: str | None = None  # the LoRA adapter these tokens run with (kvpool.runner.lora); None: the base model
    logprobs: int | None = None  # the sampled token's log-probability and this many top ones' (None: none)
    history: History | None = None  # a penalized sequence's tokens so far, and its prompt's length (sampler)
    banned: Sequence[int] | None = None  # tokens it must not draw now (stop tokens before min_tokens, bad words)
    grammar: torch.Tensor | None = None  # structured outputs: the tokens it may draw now (bool, per logit)
    # Prompt log-probabilities (SamplingParams.prompt_logprobs): which rows to score, from the forward or the
    # prompt-row cache, and which rows to keep there (kvpool.runner.prompt_rows).
    prompt_logprobs: PromptLogprobsStep | None = None


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, pack: bool = True,
               native_kernels: bool = True) -> tuple[LlamaForCausalLM, dict]:
    """The model of a local Hugging Face folder, its weights loaded (any registered architecture, see
    kvpool.runner.models.registry)."""
    from safetensors import SafetensorError, safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    entry = resolve_model_class(cfg)
    arch, cls = entry.arch_cls.from_hf_config(cfg), entry.model_cls
    with torch.device("meta"):
        model = cls(arch)  # type: ignore[arg-type]
    model = model.to_empty(device=device)
    rotaries = [m for m in model.modules() if isinstance(m, Rotary)]
    for r in rotaries:
        r.reset()  # buffers computed on the meta device are lost
        r.to(device)

    def tensors():
        for f in sorted(model_dir.glob("*.safetensors")):
            try:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        yield name, st.get_tensor(name)
            except SafetensorError as e:  # (a truncated or corrupt file: the model folder's fault)
                raise ValueError(f"model: {f} is not a readable safetensors file ({e})") from None

    model.load_weights(tensors())
    model.to(dtype)
    for r in rotaries:
        r.to(torch.float32)  # the angle tables stay fp32; cast per use
    model.eval()
    if pack and can_pack(dtype, device):
        model.pack_linears(native_kernels)
    return model, cfg


def _device(name: str) -> torch.device:
    """`name` as a torch device; a ValueError naming `device` for one that does not exist here."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {name!r} is not a device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for, but torch sees no CUDA device here")
    return dev


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def memory_of(device: torch.device) -> tuple[int | None, str]:
    """The memory tensors on `device` come from, in bytes (None where unknown), and its name for messages:
    the machine's for the CPU, the GPU's own for CUDA (checked before allocating: on a GPU, an allocation
    that fails half-way leaves what it took cached in this process, out of every other's reach)."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return torch.cuda.get_device_properties(index).total_memory, f"cuda:{index}'s memory"
    return (physical_memory() if device.type == "cpu" else None), "this machine's memory"


def release_cached_memory(device: torch.device) -> None:
    """Hand back what a failed allocation left in torch's CUDA cache (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class ModelRunner:
    def __init__(self, model_dir: Path, *, dtype: str = "auto", kv_cache_dtype: str = "auto", block_size: int = 16,
                 kv_cache_memory: int = 1 << 30, device: str | None = None, num_blocks: int | None = None,
                 enable_cascade: bool | None = None, hybrid: bool = True, stage_outputs: bool = False,
                 stage_output_layers: Sequence[int] = (), stage_output_cache: bool = False,
                 batch_invariant: bool = False, native_kernels: bool = True,
                 prompt_rows_bytes: int = 64 << 20) -> None:
        self.batch_invariant = batch_invariant  # see kvpool.runner.invariant
        self.device = _device(device) if device else default_device()
        # Cascades (None: on the CPU only) read a shared prefix's keys once per group instead of once per
        # member, which is what bounds a CPU's decode; but they split a step's attention into several
        # small calls per group (a 64-row decode step of SmolLM2 in 8 groups: 26,844 torch ops against
        # 7,787 without), and on a GPU, where each op is a kernel launch and memory is fast, the cached
        # run took twice as long as the uncached one (docs/benchmarks.md, session 16).
        self.enable_cascade = self.device.type == "cpu" if enable_cascade is None else enable_cascade
        self.dtype = resolve_dtype(dtype, self.device)
        # Keys and values are stored (every tier, the store too) in `kv_dtype`, and attention reads them back
        # as the model's dtype. A step's own keys are rounded the same way before they are attended to, so
        # a token's result does not depend on whether its context was computed in this step or cached.
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        if batch_invariant and self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"batch_invariant: needs dtype float32 or bfloat16, got {dtype!r}")
        t0 = time.perf_counter()
        # Batch-invariant fp32 pads plain linear layers to a fixed row count, each on the kernel (oneDNN's
        # packed or MKL's) found invariant so padded on this CPU (kvpool.runner.invariant.RowPaddedLinear).
        pack = not batch_invariant or self.dtype == torch.bfloat16
        self.model, self.hf_config = load_model(model_dir, self.dtype, self.device, pack, native_kernels)
        cross_layers = getattr(self.model.arch, "cross_attention_layers", ())
        if batch_invariant:
            if cross_layers:
                raise ValueError("batch_invariant: cross-attention models are not supported in this mode")
            if any(w is not None for w in self.model.arch.layer_windows):
                raise ValueError("batch_invariant: sliding-window models are not supported in this mode")
            if getattr(self.model.arch, "layer_state_shapes", None) is not None:
                raise ValueError("batch_invariant: models with state layers are not supported in this mode")
            make_batch_invariant(self.model, self.dtype)
            if self.device.type != "cpu":
                # The padding answers the CPU BLAS's choice of kernel by row count; a GPU's BLAS chooses
                # by other rules, so outputs may differ in their last bits (tokens rarely).
                log.warning("batch_invariant: bit-identical outputs are shown on the CPU only, not on %s",
                            self.device.type)
        if self.kv_dtype != self.dtype and getattr(self.model.arch, "layer_state_shapes", None) is not None:
            # Their attention pages share byte buffers with the state layers' pages (kvpool.runner.state_cache).
            raise ValueError(f"kv_cache_dtype: models with state layers keep their KV cache in the model's dtype "
                             f"({str(self.dtype).removeprefix('torch.')}); got {kv_cache_dtype!r}")
        arch = self.model.arch
        self.arch = arch
        # The compiled decode kernel covers these shapes (see decode_attention.cpp); the torch path the rest.
        kernels_here = (native_kernels and not batch_invariant and self.device.type == "cpu"
                        and self.dtype in (torch.float32, torch.bfloat16) and arch.head_dim <= 256
                        and arch.num_heads // arch.num_kv_heads <= 16 and block_size <= 256
                        and kernels.paged_decode_attention() is not None)
        # The attention kernels read a cache of the queries' dtype, and the fp32 ones (AVX2) 16-bit and fp8
        # caches too; any other KV dtype goes through torch.
        self.decode_kernel = kernels_here and (
            self.kv_dtype == self.dtype
            or (self.dtype == torch.float32 and self.kv_dtype in kernels.NARROW_KV_DTYPES
                and kernels.prefill_supported(arch.head_dim, block_size, torch.float32)))
        self.prefill_kernel = self.decode_kernel and kernels.prefill_supported(arch.head_dim, block_size, self.dtype)
        # Keys (bf16: and values) stored as the kernels read them, where those kernels read every layer's
        # cache (full attention: windowed decode rows and cross-attention read the standard layout; state
        # models share byte pages with state layers).
        self.packed_kv = (self.prefill_kernel and not cross_layers and all(w is None for w in arch.layer_windows)
                          and getattr(arch, "layer_state_shapes", None) is None)
        # The attention path, chosen once: it plans every attention group's metadata and computes it.
        self.attn_backend = select_backend(block_size=block_size, dtype=self.dtype,
                                           group_heads=arch.num_heads // arch.num_kv_heads,
                                           batch_invariant=batch_invariant, decode_kernel=self.decode_kernel,
                                           prefill_kernel=self.prefill_kernel, cascade=self.enable_cascade,
                                           packed=self.packed_kv)
        # Fused norm, rotary and SiLU-and-multiply (bf16 and fp32): modules with a `fused` slot use them when set.
        self.fused_ops = kernels_here
        self._argmax_rows = kernels.fused_ops().argmax_rows if self.fused_ops else None
        if self.fused_ops:
            for m in self.model.modules():
                if hasattr(m, "fused"):
                    m.fused = kernels.fused_ops()
        self.block_size = block_size
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        state_shapes = getattr(arch, "layer_state_shapes", None)  # models with recurrent-state layers
        if state_shapes is None:
            self.layout = LayerLayout.from_windows(arch.layer_windows, block_size, arch.num_kv_heads, arch.head_dim,
                                                   elem, hybrid=hybrid, cross_layers=cross_layers,
                                                   max_encoder_tokens=getattr(arch, "num_encoder_tokens", 0))
        else:
            if not hybrid:
                raise ValueError("hybrid_allocator: a model with state layers needs the hybrid allocator")
            self.layout = LayerLayout.from_specs(
                layer_specs(state_shapes, block_size, arch.num_kv_heads, arch.head_dim, elem), arch.layer_windows)
        self._state_groups = {g for g, s in enumerate(self.layout.specs) if isinstance(s, MambaSpec)}
        # Per-group metadata is planned by the planner of the group's spec type.
        self._planners: dict[type[KVCacheSpec], Any] = {
            FullAttentionSpec: self._plan_attention, SlidingWindowSpec: self._plan_attention,
            CrossAttentionSpec: self._plan_cross, MambaSpec: self._plan_state}
        self._cross_groups = self.layout.cross_groups  # planned by plan_cross_attention, not by position
        self._views, self._view_of_layer = self.layout.attention_views()
        groups = [g for g, _ in self._views]
        self._shared_groups = {g for g in groups if groups.count(g) > 1}  # groups seen through several windows
        # A block id is one page in each of the layers_per_group shared tensors (see LayerLayout).
        self.bytes_per_block = (2 * block_size * arch.num_kv_heads * arch.head_dim * elem
                                * self.layout.layers_per_group)
        if state_shapes is not None:
            # One pool for pages of several sizes: a "block" of the manager is a large page.
            self.bytes_per_block = large_page_bytes(self.layout.specs, self.layout.layers_per_group)
        # The stage-output cache keeps each cached token's final hidden state (and each captured layer's) in
        # host memory beside its block: counted in the host tier's budget, and in the KV cache's where that
        # is host memory too (a CPU device), so that a budget is what the caches take.
        self.stage_bytes_per_block = (block_size * arch.hidden_size * torch.empty((), dtype=self.dtype).element_size()
                                      * (1 + len(stage_output_layers)) if stage_outputs and stage_output_cache else 0)
        self.host_bytes_per_block = self.bytes_per_block + self.stage_bytes_per_block
        device_block = self.host_bytes_per_block if self.device.type == "cpu" else self.bytes_per_block
        if num_blocks is None:
            num_blocks = kv_cache_memory // device_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory: {kv_cache_memory} bytes hold {num_blocks} blocks of "
                             f"{device_block} bytes; at least 2 are needed")
        self.num_blocks = num_blocks
        # (kv_heads, blocks, block_size, head_dim): one head's keys of a block table gather contiguously.
        shape = (arch.num_kv_heads, num_blocks, block_size, arch.head_dim)
        self.paged: PagedBuffers | None = None
        ram, where = memory_of(self.device)
        if ram is not None and num_blocks * device_block > ram:
            raise ValueError(f"kv_cache_memory: {num_blocks} blocks ({num_blocks * device_block / 2**30:.1f} "
                             f"GiB) are more than {where} ({ram / 2**30:.1f} GiB)")
        failure = None
        try:
            if state_shapes is not None:
                self.paged = PagedBuffers(self.layout.specs, self.layout.group_of_layer,
                                          self.layout.tensor_of_layer, num_blocks, self.dtype, self.device)
                self.kv_tensors = []
                self.kv_caches = self.paged.caches  # type: ignore[assignment]
            else:
                self.kv_tensors = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                                    torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                                   for _ in range(self.layout.layers_per_group)]
                self.kv_caches = [self.kv_tensors[t] for t in self.layout.tensor_of_layer]  # per layer, shared
        except (RuntimeError, MemoryError) as e:  # torch's out-of-memory errors are RuntimeErrors
            failure = str(e).splitlines()[0]
        if failure is not None:
            # (raised outside the handler: no frame holding what was allocated outlives it; see LoRARegistry)
            self.paged = None
            release_cached_memory(self.device)
            raise ValueError(f"kv_cache_memory: {num_blocks} blocks of {self.bytes_per_block} bytes could not be "
                             f"allocated on {self.device} ({failure})")
        self.num_tokens_computed = 0
        self.num_cascade_steps = 0  # steps in which some sequences attended a shared prefix together
        self.num_grouped_decode_steps = 0  # steps whose decode kernel read a shared prefix once for a group
        self.host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Two-level pools: per page type, per device byte buffer, a (host pages, page elements) tensor.
        self.host_pages: list[list[torch.Tensor]] = []
        self._page_elems: list[int] = []
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.swap_seconds = 0.0
        # Omni stages: per-token outputs of the last step (request id -> name -> rows), and their
        # cache beside the KV blocks (see stage_output_cache.py).
        for i in stage_output_layers:
            if not 0 <= i < arch.num_layers:
                raise ValueError(f"stage_output_layers: layer {i} is not in [0, {arch.num_layers})")
        self.stage_outputs = stage_outputs
        self.stage_output_layers = tuple(stage_output_layers)
        self.stage_cache = StageOutputCache(num_blocks, block_size) if stage_outputs and stage_output_cache else None
        specs = self.layout.specs
        if self.stage_cache is not None and (len(specs) != 1 or not isinstance(specs[0], FullAttentionSpec)):
            # Rows live at group 0's slots; a sliding group's table holds null blocks.
            raise ValueError("stage_output_cache: needs a model whose layers are all full attention")
        self.last_outputs: dict[str, dict[str, torch.Tensor]] = {}
        # The last step's log-probabilities, by request, for the sequences that asked for them (SeqStep.logprobs).
        self.last_logprobs: dict[str, TokenLogprobs] = {}
        # ... and the prompt tokens' the last step scored (SeqStep.prompt_logprobs): (first row, rows in order).
        self.last_prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        # Prompt positions' last hidden states by block hash, so a request scoring its prompt can take a hit.
        self.prompt_rows = (PromptRowCache(prompt_rows_bytes, block_size, block_size * self.arch.hidden_size
                                           * self.dtype.itemsize) if prompt_rows_bytes else None)
        self.lora: LoRAManager | None = None  # set by enable_lora
        log.info("model %s loaded in %.1fs (%s, %s); KV cache: %d blocks of %d tokens (%.1f MiB, %s)",
                 model_dir.name, time.perf_counter() - t0, self.dtype, self.device, num_blocks, block_size,
                 num_blocks * self.bytes_per_block / 2**20, self.kv_dtype)
        on = [name for name, used in (("decode attention", self.decode_kernel), ("prefill attention",
              self.prefill_kernel), ("fused norm/rotary/SiLU", self.fused_ops)) if used]
        log.info("kvpool CPU kernels: %s", ", ".join(on) if on else "none (torch ops)")

    def enable_lora(self, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None) -> LoRAManager:
        """Wrap the projections for LoRA adapters (kvpool.runner.lora); ValueError for models without."""
        if self.batch_invariant:
            raise ValueError("enable_lora: not supported together with batch_invariant")
        self.lora = LoRAManager(self.model, max_loras=max_loras, max_rank=max_lora_rank, dtype=self.dtype,
                                device=self.device, max_cpu_loras=max_cpu_loras)
        return self.lora

    @property
    def kv_layout(self) -> str:
        """How a block's bytes are ordered: "standard" ((kv_heads, block_size, head_dim) per K and V),
        "packed16" (bf16) or "packed8" (fp32), see kvpool.runner.kernels.packed_layout. Blocks of one are
        garbage to another, so the store's fingerprint carries it."""
        if not self.packed_kv:
            return "standard"
        return "packed16" if self.dtype == torch.bfloat16 else "packed8"  # (fp32 queries: 8-key tiles, any KV dtype)

    @property
    def max_model_len(self) -> int:
        return self.arch.max_position

    @property
    def num_embeddings(self) -> int:
        """Rows of the embedding table: valid token ids are below (special tokens may follow the vocabulary)."""
        return int(self.model.embed_tokens.num_embeddings)

    @functools.cached_property
    def num_logits(self) -> int:
        """The LM head's width: the tokens a step can give (Mllama's image token, past it, is never given)."""
        hidden = torch.zeros(1, self.model.embed_tokens.embedding_dim, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            return int(self.model.compute_logits(hidden).shape[-1])

    def make_input_processor(self, vision_encoder: Any = None, encoder_cache_bytes: int = 256 << 20
                             ) -> InputProcessor:
        """The model's input processor (registered with it), with an encoder cache of that many bytes."""
        cache = EncoderCache(encoder_cache_bytes)
        factory = resolve_model_class(self.hf_config).inputs
        if factory is not None:
            return factory(self.model, vision_encoder, cache)
        return MultiModalProcessor(self.arch.hidden_size, vision_encoder, cache=cache)

    @property
    def page_sizes(self) -> list[int] | None:
        """Per KV cache group, the bytes of one page when they differ (the manager's two-level pool)."""
        return self.paged.page_sizes if self.paged is not None else None

    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per KV cache group, for the manager (group i of the manager is group i here)."""
        return list(self.layout.specs)

    def _metadata(self, steps: list[SeqStep]
                  ) -> tuple[torch.Tensor, torch.Tensor, list[GroupMetadata]]:
        """Token ids, positions, and the attention metadata of each KV cache group for a step."""
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        positions: list[int] = []
        n_groups = self.layout.num_groups
        slot_lists: list[list[int]] = [[] for _ in range(n_groups)]
        seqs: list[list[SeqAttn]] = [[] for _ in range(n_groups)]
        spans: list[tuple[int, int, int]] = []  # per sequence: first row, first position, tokens
        state_tables: list[list[list[int]]] = [[] for _ in range(n_groups)]
        t = 0
        for s in steps:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            end = s.start_pos + n
            n_blocks = -(-end // bs)
            positions.extend(range(s.start_pos, end))
            tables = s.group_block_ids if s.group_block_ids is not None else (s.block_ids,)
            if len(tables) != n_groups:
                raise ValueError(f"{s.req_id}: {len(tables)} block tables for {n_groups} KV cache groups")
            spans.append((t, s.start_pos, n))
            for g, block_ids in enumerate(tables):
                if g in self._cross_groups:
                    continue
                if n_blocks > len(block_ids):
                    raise ValueError(f"{s.req_id}: block table too short for {end} tokens")
                if g in self._state_groups:
                    state_tables[g].append(block_ids)
                    continue
                # Plain Python for the per-token arithmetic: a decode row is one token, and a tensor op per
                # sequence cost more than the whole list of a 64-row step.
                table = block_ids[:n_blocks]
                slot_lists[g].extend([table[p // bs] * bs + p % bs for p in range(s.start_pos, end)])
                seqs[g].append(SeqAttn(t, t + n, end, None, ids=table, device=dev))
            t += n
        slots = [torch.tensor(c, dtype=torch.long, device=dev) for c in slot_lists]
        plan = _StepPlan(steps, spans, slots, seqs, state_tables)
        metas: list[GroupMetadata] = [self._planner(g)(plan, g, window) for g, window in self._views]
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                metas)

    def _planner(self, g: int) -> Any:
        spec = type(self.layout.specs[g])
        for cls in spec.__mro__:
            if cls in self._planners:
                return self._planners[cls]
        raise TypeError(f"no metadata planner for KV cache group {g} ({spec.__name__})")

    def _plan_state(self, plan: _StepPlan, g: int, window: int | None) -> GroupMetadata:
        return plan_state(plan.spans, plan.state_tables[g], self.block_size, self.device)

    def _plan_cross(self, plan: _StepPlan, g: int, window: int | None) -> GroupMetadata:
        return plan_cross_attention(plan.steps, g, self.block_size, self.dtype, self.device)

    def _plan_attention(self, plan: _StepPlan, g: int, window: int | None) -> GroupMetadata:
        # Planning annotates the sequences, so each view of a group gets its own copies.
        group_seqs = [replace(x) for x in plan.seqs[g]] if g in self._shared_groups else plan.seqs[g]
        meta = AttentionMetadata(slot_mapping=plan.slots[g], seqs=group_seqs, window=window)
        # Masks depend on positions and the window, not on block ids: groups of one window share them.
        twin = plan.masks_by_window.get(window) if window is not None else None
        self.attn_backend.plan(meta, twin)
        if twin is None and window is not None:
            plan.masks_by_window[window] = meta
        if g == 0:
            self.num_cascade_steps += bool(meta.groups)
            shared = meta.decode_shared
            self.num_grouped_decode_steps += bool(shared is not None and shared.any())
        return meta

    def allocate_host_cache(self, swap_space: int) -> int:
        """Host-tier KV tensors of `swap_space` bytes (pinned when a GPU will copy from them); returns
        the manager's `num_host_blocks` (blocks, or large pages when the pool is two-level)."""
        n = swap_space // self.host_bytes_per_block  # (its stage-output rows too: see __init__)
        self.host_kv_caches = []
        self.host_pages = []
        if n < 1:
            return 0
        pin = self.device.type == "cuda"
        total = n * self.host_bytes_per_block
        ram = physical_memory()
        if ram is not None and total > ram:
            # (zeroed tensors touch every page: past the machine's memory the kernel kills the process, with
            # no error to show)
            raise ValueError(f"swap_space: {n} host blocks ({total / 2**30:.1f} GiB) are more than this machine's "
                             f"memory ({ram / 2**30:.1f} GiB)")
        try:
            if self.paged is not None:
                # Two-level pool: one host pool per page size, the memory split evenly in bytes between them
                # (the manager splits its host blocks the same way); per page type, one (pages, page) tensor
                # for each of the device's byte buffers.
                sizes = sorted(set(self.paged.page_sizes))
                counts = split_host_pages(n, [self.bytes_per_block // p for p in sizes])
                if min(counts) < 1:
                    return 0
                elem = torch.empty((), dtype=self.dtype).element_size()
                slots = len(self.paged.buffers)
                self._page_elems = [p // slots // elem for p in sizes]
                self.host_pages = [[torch.zeros((c, pe), dtype=self.dtype, pin_memory=pin) for _ in range(slots)]
                                   for c, pe in zip(counts, self._page_elems, strict=True)]
            else:
                shape = (self.arch.num_kv_heads, n, self.block_size, self.arch.head_dim)
                self.host_kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, pin_memory=pin),
                                        torch.zeros(shape, dtype=self.kv_dtype, pin_memory=pin))
                                       for _ in self.kv_tensors]
        except (RuntimeError, MemoryError) as e:  # torch's out-of-memory errors are RuntimeErrors
            self.host_kv_caches, self.host_pages = [], []
            raise ValueError(f"swap_space: {n} host blocks of {self.bytes_per_block} bytes could not be allocated "
                             f"({str(e).splitlines()[0]})") from None
        log.info("host KV tier: %d blocks (%.1f MiB)", n, n * self.host_bytes_per_block / 2**20)
        if self.stage_cache is not None:
            self.stage_cache.set_num_host_blocks(n)
        return n

    def execute_swaps(self, plan: SwapPlan | None) -> None:
        """Copy blocks between tiers: every swap-out, then every swap-in (a device block evicted this
        step may be the destination of a swap-in of the same step)."""
        if not plan:
            return
        if not self.host_kv_caches and not self.host_pages:
            raise RuntimeError("swap plan given but this runner has no host KV tier")
        t0 = time.perf_counter()
        dev = self.device
        typed_out, typed_in = plan.typed_out, plan.typed_in
        if self.paged is not None and (plan.swap_out or plan.swap_in):
            # Paged buffers under a one-level pool (every group's page the same size, so one page type whose
            # page ids are the block ids): the plan's pairs are copies of that type. (The KV tensors of the
            # path below are empty here: copying through them did nothing, and host hits read stale pages.)
            typed_out = [*typed_out, *((0, d, h) for d, h in plan.swap_out)]
            typed_in = [*typed_in, *((0, h, d) for h, d in plan.swap_in)]
        elif plan.swap_out:
            d_ids = torch.tensor([d for d, _ in plan.swap_out], dtype=torch.long, device=dev)
            h_ids = torch.tensor([h for _, h in plan.swap_out], dtype=torch.long)
            # Every layer's blocks start their way to the host at once; the host may read them only once
            # the copies are done (an asynchronous copy returns before its bytes land).
            staged = [(dk.index_select(1, d_ids).to("cpu", non_blocking=True),
                       dv.index_select(1, d_ids).to("cpu", non_blocking=True)) for dk, dv in self.kv_tensors]
            if dev.type == "cuda":
                torch.cuda.current_stream().synchronize()
            for (hk, hv), (sk, sv) in zip(self.host_kv_caches, staged, strict=True):
                indexable(hk).index_copy_(1, h_ids, indexable(sk))
                indexable(hv).index_copy_(1, h_ids, indexable(sv))
        self._copy_pages(typed_out, to_host=True)
        if plan.swap_in and self.paged is None:
            h_ids = torch.tensor([h for h, _ in plan.swap_in], dtype=torch.long)
            d_ids = torch.tensor([d for _, d in plan.swap_in], dtype=torch.long, device=dev)
            for (dk, dv), (hk, hv) in zip(self.kv_tensors, self.host_kv_caches, strict=True):
                indexable(dk).index_copy_(1, d_ids, indexable(hk).index_select(1, h_ids).to(dev, non_blocking=True))
                indexable(dv).index_copy_(1, d_ids, indexable(hv).index_select(1, h_ids).to(dev, non_blocking=True))
        self._copy_pages(typed_in, to_host=False)
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the forward must see the copies
        if self.stage_cache is not None:
            self.stage_cache.apply_swaps(plan)  # the stage outputs follow their blocks between tiers
        self.num_blocks_swapped_out += len(plan.swap_out) + len(plan.typed_out)
        self.num_blocks_swapped_in += len(plan.swap_in) + len(plan.typed_in)
        # Measured so the case for overlapping copies with compute (a copy thread) rests on numbers.
        self.swap_seconds += time.perf_counter() - t0

    def synchronize(self) -> None:
        """Wait for the work queued on the device (a GPU runs kernels after `execute` returns); a no-op on
        the CPU. For timing a step."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _copy_pages(self, copies: list[tuple[int, int, int]], to_host: bool) -> None:
        """Two-level pools: copy (page type, src, dst) pages between the device's byte buffers and the
        host pages of that type (a page of type t is the t-th smallest page size, in every buffer)."""
        if not copies:
            return
        assert self.paged is not None
        for t, pe in enumerate(self._page_elems):
            mine = [(src, dst) for pt, src, dst in copies if pt == t]
            if not mine:
                continue
            src = torch.tensor([a for a, _ in mine], dtype=torch.long)
            dst = torch.tensor([b for _, b in mine], dtype=torch.long)
            for buf, host in zip(self.paged.buffers, self.host_pages[t], strict=True):
                pages = buf.view(-1, pe)
                if to_host:
                    host.index_copy_(0, dst, pages.index_select(0, src.to(buf.device)).to("cpu"))
                else:
                    pages.index_copy_(0, dst.to(buf.device), host.index_select(0, src).to(buf.device))

    def _forward_with_outputs(self, steps: list[SeqStep], input_ids: torch.Tensor, positions: torch.Tensor,
                              meta: AttentionMetadata | list[AttentionMetadata], slot_mapping: torch.Tensor
                              ) -> torch.Tensor:
        """The forward with input embeddings and/or per-token outputs (into `last_outputs`)."""
        rows: list[int] = []
        chunks: list[torch.Tensor] = []
        t = 0
        for s in steps:
            if s.embeds is not None:
                local, emb = s.embeds
                if emb.shape[0] != len(local) or emb.shape[-1] != self.arch.hidden_size:
                    raise ValueError(f"{s.req_id}: embeddings of shape {tuple(emb.shape)} for {len(local)} rows; "
                                     f"hidden size is {self.arch.hidden_size}")
                rows.extend(t + r for r in local)
                chunks.append(emb)
            t += len(s.token_ids)
        embeds = None
        if rows:
            embeds = (torch.tensor(rows, dtype=torch.long, device=self.device), torch.cat(chunks).to(self.device))
        capture: dict[str, torch.Tensor] = {}
        hidden = self.model(input_ids, positions, self.kv_caches, meta, inputs_embeds=embeds,
                            capture=capture, capture_layers=self.stage_output_layers)
        self.last_outputs = {}
        if self.stage_outputs:
            outputs = {"hidden_states": hidden, **capture}
            outputs = {k: v.to("cpu") for k, v in outputs.items()}
            if self.stage_cache is not None:
                self.stage_cache.write(outputs, slot_mapping)
            t = 0
            for s in steps:
                n = len(s.token_ids)
                self.last_outputs[s.req_id] = {k: v[t:t + n] for k, v in outputs.items()}
                t += n
        return hidden

    # Rows of prompt logits computed at once: a (rows, vocabulary) float32 block (256 x 49,152: 48 MiB), so
    # that a long prompt's log-probabilities never hold its whole logits matrix.
    PROMPT_LOGPROBS_ROWS = 256

    def _prompt_logprobs(self, steps: list[SeqStep], hidden: torch.Tensor) -> None:
        """Score each scoring request's rows (SeqStep.prompt_logprobs): cached blocks from their kept scores
        where those hold the top count asked (their last row, whose next token lies past the block, through
        the LM head), else from their rows; then this step's rows. Every read comes before any write: a write
        may evict an entry another request of this step reads."""
        cache = self.prompt_rows
        jobs = []
        t = 0
        for s in steps:
            n = len(s.token_ids)
            p = s.prompt_logprobs
            if p is not None:
                out: list[TokenLogprobs | None] = [None] * len(p.targets)
                rows: list[torch.Tensor] = []  # hidden rows to score, and the outputs they fill
                where: list[int] = []
                pos = 0
                for block in cache.read(p.read) if p.read and cache is not None else ():
                    bs = block.rows.shape[0]
                    kept = block.scores_for(p.k)
                    if kept is not None:
                        out[pos:pos + bs - 1] = kept
                        rows.append(block.rows[bs - 1:])
                        where.append(pos + bs - 1)
                    else:
                        rows.append(block.rows)
                        where.extend(range(pos, pos + bs))
                    pos += bs
                computed = len(p.targets) - pos  # (rows of this step's forward that are scored)
                if computed > 0:
                    rows.append(hidden[t:t + computed])
                    where.extend(range(pos, pos + computed))
                jobs.append((s, p, t, out, rows, where))
            t += n
        for s, p, t, out, rows, where in jobs:
            if where:
                hid = torch.cat([r.to(hidden.device, hidden.dtype) for r in rows])
                targets = [p.targets[i] for i in where]
                # (batch invariant: one row per call, as the sampled rows, so a hit scores as a cold run)
                step = 1 if self.batch_invariant else self.PROMPT_LOGPROBS_ROWS
                for a in range(0, len(where), step):
                    b = min(a + step, len(where))
                    scored = token_logprobs(self.model.compute_logits(hid[a:b]), targets[a:b], [p.k] * (b - a))
                    for i, lp in zip(where[a:b], scored, strict=True):
                        out[i] = lp
            if p.targets:
                self.last_prompt_logprobs[s.req_id] = (p.first, out)  # type: ignore[assignment]
            if p.write and cache is not None:
                bs, start, end = cache.block_size, s.start_pos, s.start_pos + len(s.token_ids)
                for h, pos in p.write:
                    a, b = max(pos, start), min(pos + bs, end)
                    # (row r's score is out[r - first], where r is scored; the block's last row keeps none)
                    scores = [out[r - p.first] if r - p.first < len(out) else None for r in range(a, b)]
                    cache.write(h, a - pos, hidden[t + a - start:t + b - start], scores, p.k)
        if cache is not None and jobs:
            for _s, p, *_rest in jobs:  # (each prompt's first block last: it goes last; module doc)
                cache.touch(p.chain[::-1])
            cache.shrink()

    @torch.inference_mode()
    def execute(self, steps: list[SeqStep], swap_plan: SwapPlan | None = None) -> dict[str, int]:
        """Run one forward over all scheduled tokens; return the sampled token of each finishing chunk.

        The step's swap plan runs first: the forward may read blocks it copies in.
        """
        self.execute_swaps(swap_plan)
        self.last_logprobs = {}
        self.last_prompt_logprobs = {}
        if not steps:
            return {}
        if self.lora is not None:
            steps = self.lora.begin_step(steps)  # rows sorted by adapter, each adapter's rows contiguous
        input_ids, positions, metas = self._metadata(steps)
        meta = metas[0] if len(metas) == 1 else [metas[v] for v in self._view_of_layer]
        if not self.stage_outputs and all(s.embeds is None for s in steps):
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        else:
            hidden = self._forward_with_outputs(steps, input_ids, positions, meta,
                                                getattr(metas[0], "slot_mapping", None))
        self.num_tokens_computed += int(input_ids.shape[0])
        if self.lora is not None:
            self.lora.end_step()
        if any(s.prompt_logprobs is not None for s in steps):
            self._prompt_logprobs(steps, hidden)
        rows, want = [], []
        t = 0
        for s in steps:
            t += len(s.token_ids)
            if s.sample:
                rows.append(t - 1)
                want.append(s)
        if not want:
            return {}
        last = hidden[torch.tensor(rows, device=self.device)]
        if self.batch_invariant:
            # One row per call, so always the one-row kernel, whatever the batch: as invariant as
            # padding to MIN_ROWS, without 16 rows' worth of the vocabulary-wide matmul per token.
            logits = torch.cat([self.model.compute_logits(last[i:i + 1]) for i in range(len(rows))])
        elif all(is_greedy(s.sampling) and s.logprobs is None and s.history is None and s.banned is None
                 and s.grammar is None and not biases(s.sampling) and not allowed(s.sampling) for s in want):
            # All greedy: argmax straight off the model-dtype logits (no fp32 copy of the vocabulary-wide rows).
            tokens = self.model.greedy_tokens(last, self._argmax_rows).tolist()
            return {s.req_id: tok for s, tok in zip(want, tokens, strict=True)}
        else:
            logits = self.model.compute_logits(last)
        params = [s.sampling for s in want]
        tokens = sample(logits, params, [s.generator for s in want], [s.history for s in want],  # type: ignore[arg-type]
                        [s.banned for s in want], [s.grammar for s in want])
        asked = [i for i, s in enumerate(want) if s.logprobs is not None]
        if asked:  # (greedy rows too take their token off these fp32 logits: the argmax is the same)
            lps = token_logprobs(logits[asked], [tokens[i] for i in asked], [want[i].logprobs for i in asked])  # type: ignore[misc]
            self.last_logprobs = {want[i].req_id: lp for i, lp in zip(asked, lps, strict=True)}
        return {s.req_id: tok for s, tok in zip(want, tokens, strict=True)}
