"""The model runner: owns the model and the paged KV tensors, and executes one engine step.

A step is a list of `SeqStep`s (which tokens of which request to compute, at which positions, into
which blocks). The runner executes the step's swap plan first (see `kvpool.core.swap`), builds the
slot mapping and block tables, runs the forward pass once over every token of the step, and samples
the sequences that reached their last known token.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvpool.core.kv_cache_spec import KVCacheSpec
from kvpool.core.swap import SwapPlan
from kvpool.runner.attention import (
    AttentionMetadata,
    SeqAttn,
    plan_cascades,
    plan_decode_batch,
    plan_masks,
    plan_windows,
)
from kvpool.runner.gemma3 import Gemma3Arch, Gemma3ForCausalLM
from kvpool.runner.layer_layout import LayerLayout
from kvpool.runner.llama import LlamaArch, LlamaForCausalLM, Rotary, can_pack
from kvpool.runner.sampler import SamplingLike, sample

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
SUPPORTED_ARCHS = {"llama", "mistral", "qwen2"}
GEMMA3_ARCHS = {"gemma3_text"}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> tuple[LlamaForCausalLM, dict]:
    """The model of a local Hugging Face folder, its weights loaded (Llama family or Gemma-3 text)."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    mtype = cfg.get("model_type")
    if mtype in SUPPORTED_ARCHS:
        arch: LlamaArch = LlamaArch.from_hf_config(cfg)
        cls: type[LlamaForCausalLM] = LlamaForCausalLM
    elif mtype in GEMMA3_ARCHS:
        arch, cls = Gemma3Arch.from_hf_config(cfg), Gemma3ForCausalLM
    else:
        supported = sorted(SUPPORTED_ARCHS | GEMMA3_ARCHS)
        raise ValueError(f"model: architecture {mtype!r} is not supported (supported: {supported})")
    with torch.device("meta"):
        model = cls(arch)  # type: ignore[arg-type]
    model = model.to_empty(device=device)
    rotaries = [m for m in model.modules() if isinstance(m, Rotary)]
    for r in rotaries:
        r.reset()  # buffers computed on the meta device are lost
        r.to(device)

    def tensors():
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, st.get_tensor(name)

    model.load_weights(tensors())
    model.to(dtype)
    for r in rotaries:
        r.to(torch.float32)  # the angle tables stay fp32; cast per use
    model.eval()
    if can_pack(dtype, device):
        model.pack_linears()
    return model, cfg


class ModelRunner:
    def __init__(self, model_dir: Path, *, dtype: str = "bfloat16", block_size: int = 16,
                 kv_cache_memory: int = 1 << 30, device: str | None = None, num_blocks: int | None = None,
                 enable_cascade: bool = True, hybrid: bool = True) -> None:
        self.enable_cascade = enable_cascade
        self.device = torch.device(device) if device else default_device()
        self.dtype = resolve_dtype(dtype)
        t0 = time.perf_counter()
        self.model, self.hf_config = load_model(model_dir, self.dtype, self.device)
        arch = self.model.arch
        self.arch = arch
        self.block_size = block_size
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.layout = LayerLayout.from_windows(arch.layer_windows, block_size, arch.num_kv_heads, arch.head_dim, elem,
                                               hybrid=hybrid)
        self._views, self._view_of_layer = self.layout.attention_views()
        # A block id is one page in each of the layers_per_group shared tensors (see LayerLayout).
        self.bytes_per_block = (2 * block_size * arch.num_kv_heads * arch.head_dim * elem
                                * self.layout.layers_per_group)
        if num_blocks is None:
            num_blocks = kv_cache_memory // self.bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory: {kv_cache_memory} bytes hold {num_blocks} blocks of "
                             f"{self.bytes_per_block} bytes; at least 2 are needed")
        self.num_blocks = num_blocks
        # (kv_heads, blocks, block_size, head_dim): one head's keys of a block table gather contiguously.
        shape = (arch.num_kv_heads, num_blocks, block_size, arch.head_dim)
        self.kv_tensors = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                            torch.zeros(shape, dtype=self.dtype, device=self.device))
                           for _ in range(self.layout.layers_per_group)]
        self.kv_caches = [self.kv_tensors[t] for t in self.layout.tensor_of_layer]  # per layer, shared
        self.num_tokens_computed = 0
        self.num_cascade_steps = 0  # steps in which some sequences attended a shared prefix together
        self.host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.swap_seconds = 0.0
        log.info("model %s loaded in %.1fs (%s, %s); KV cache: %d blocks of %d tokens (%.1f MiB)",
                 model_dir.name, time.perf_counter() - t0, self.dtype, self.device, num_blocks, block_size,
                 num_blocks * self.bytes_per_block / 2**20)

    @property
    def max_model_len(self) -> int:
        return self.arch.max_position

    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per KV cache group, for the manager (group i of the manager is group i here)."""
        return list(self.layout.specs)

    def _metadata(self, steps: list[SeqStep]) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """Token ids, positions, and the attention metadata of each KV cache group for a step."""
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        pos_chunks: list[torch.Tensor] = []
        n_groups = self.layout.num_groups
        slot_chunks: list[list[torch.Tensor]] = [[] for _ in range(n_groups)]
        seqs: list[list[SeqAttn]] = [[] for _ in range(n_groups)]
        t = 0
        for s in steps:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            end = s.start_pos + n
            n_blocks = -(-end // bs)
            pos = torch.arange(s.start_pos, end, dtype=torch.long)
            pos_chunks.append(pos)
            tables = s.group_block_ids if s.group_block_ids is not None else (s.block_ids,)
            if len(tables) != n_groups:
                raise ValueError(f"{s.req_id}: {len(tables)} block tables for {n_groups} KV cache groups")
            for g, block_ids in enumerate(tables):
                if n_blocks > len(block_ids):
                    raise ValueError(f"{s.req_id}: block table too short for {end} tokens")
                table = torch.tensor(block_ids[:n_blocks], dtype=torch.long)
                slot_chunks[g].append(table[pos // bs] * bs + pos % bs)
                seqs[g].append(SeqAttn(t, t + n, end, table.to(dev)))
            t += n
        metas = []
        slots = [torch.cat(c).to(dev) for c in slot_chunks]
        for g, window in self._views:
            # Planning annotates the sequences, so each view of a group gets its own copies.
            views_of_g = sum(v[0] == g for v in self._views)
            group_seqs = seqs[g] if views_of_g == 1 else [replace(x) for x in seqs[g]]
            meta = AttentionMetadata(slot_mapping=slots[g], seqs=group_seqs, window=window)
            plan_windows(meta, bs)
            if self.enable_cascade:
                plan_cascades(meta, bs)
                self.num_cascade_steps += bool(meta.groups) and g == 0
            plan_decode_batch(meta, bs)
            plan_masks(meta, self.dtype, self.arch.num_heads // self.arch.num_kv_heads, bs)
            metas.append(meta)
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.cat(pos_chunks).to(dev), metas)

    def allocate_host_cache(self, swap_space: int) -> int:
        """Host-tier KV tensors of `swap_space` bytes (pinned when a GPU will copy from them)."""
        n = swap_space // self.bytes_per_block
        if n < 1:
            self.host_kv_caches = []
            return 0
        pin = self.device.type == "cuda"
        shape = (self.arch.num_kv_heads, n, self.block_size, self.arch.head_dim)
        self.host_kv_caches = [(torch.zeros(shape, dtype=self.dtype, pin_memory=pin),
                                torch.zeros(shape, dtype=self.dtype, pin_memory=pin))
                               for _ in self.kv_tensors]
        log.info("host KV tier: %d blocks (%.1f MiB)", n, n * self.bytes_per_block / 2**20)
        return n

    def execute_swaps(self, plan: SwapPlan | None) -> None:
        """Copy blocks between tiers: every swap-out, then every swap-in (a device block evicted this
        step may be the destination of a swap-in of the same step)."""
        if not plan:
            return
        if not self.host_kv_caches:
            raise RuntimeError("swap plan given but this runner has no host KV tier")
        t0 = time.perf_counter()
        dev = self.device
        if plan.swap_out:
            d_ids = torch.tensor([d for d, _ in plan.swap_out], dtype=torch.long, device=dev)
            h_ids = torch.tensor([h for _, h in plan.swap_out], dtype=torch.long)
            for (dk, dv), (hk, hv) in zip(self.kv_tensors, self.host_kv_caches, strict=True):
                hk.index_copy_(1, h_ids, dk.index_select(1, d_ids).to("cpu", non_blocking=True))
                hv.index_copy_(1, h_ids, dv.index_select(1, d_ids).to("cpu", non_blocking=True))
        if plan.swap_in:
            h_ids = torch.tensor([h for h, _ in plan.swap_in], dtype=torch.long)
            d_ids = torch.tensor([d for _, d in plan.swap_in], dtype=torch.long, device=dev)
            for (dk, dv), (hk, hv) in zip(self.kv_tensors, self.host_kv_caches, strict=True):
                dk.index_copy_(1, d_ids, hk.index_select(1, h_ids).to(dev, non_blocking=True))
                dv.index_copy_(1, d_ids, hv.index_select(1, h_ids).to(dev, non_blocking=True))
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the forward must see the copies
        self.num_blocks_swapped_out += len(plan.swap_out)
        self.num_blocks_swapped_in += len(plan.swap_in)
        # Measured so the case for overlapping copies with compute (a copy thread) rests on numbers.
        self.swap_seconds += time.perf_counter() - t0

    @torch.inference_mode()
    def execute(self, steps: list[SeqStep], swap_plan: SwapPlan | None = None) -> dict[str, int]:
        """Run one forward over all scheduled tokens; return the sampled token of each finishing chunk.

        The step's swap plan runs first: the forward may read blocks it copies in.
        """
        self.execute_swaps(swap_plan)
        if not steps:
            return {}
        input_ids, positions, metas = self._metadata(steps)
        hidden = self.model(input_ids, positions, self.kv_caches,
                            metas[0] if len(metas) == 1 else [metas[v] for v in self._view_of_layer])
        self.num_tokens_computed += int(input_ids.shape[0])
        rows, want = [], []
        t = 0
        for s in steps:
            t += len(s.token_ids)
            if s.sample:
                rows.append(t - 1)
                want.append(s)
        if not want:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        params = [s.sampling for s in want]
        tokens = sample(logits, params, [s.generator for s in want])  # type: ignore[arg-type]
        return {s.req_id: tok for s, tok in zip(want, tokens, strict=True)}
