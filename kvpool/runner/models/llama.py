"""A Llama-family decoder (Llama, SmolLM2, Mistral-style GQA) written against the paged KV cache.

RMSNorm, rotary embeddings, grouped-query attention through `paged_attention`, SwiGLU MLP, optional
tied embeddings. q/k/v and gate/up projections are fused at load time: one matmul each instead of
three and two. Weight names are the Hugging Face ones, so a transformers checkpoint loads as is.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.runner.attention import AttentionMetadata, paged_attention
from kvpool.runner.invariant import rows_invariant
from kvpool.runner.models.registry import register_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q, k and v projections with a bias (Qwen2's always)
    o_bias: bool = False  # the output projection too (Llama's `attention_bias`; not Qwen2's)
    sliding_window: int | None = None  # every layer attends to this many recent positions (Mistral)
    rope_scaling: float = 1.0  # linear RoPE scaling: positions divided by this factor

    @property
    def layer_windows(self) -> list[int | None]:
        return [self.sliding_window] * self.num_layers

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaArch:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.hidden_act: {act!r} is not supported (silu only)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        scaling = rope_factor(rope)
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        max_position = cfg.get("max_position_embeddings", 2048)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window is not None and cfg.get("model_type") == "qwen2":
            raise ValueError("config.use_sliding_window: Qwen2's per-layer windows are not supported")
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position=max_position,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # (Qwen2's config has no `attention_bias`: its q, k and v projections always have one, its
            # output projection none; Llama's `attention_bias` gives all four one)
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            o_bias=bool(cfg.get("attention_bias", False)) and cfg.get("model_type") != "qwen2",
            sliding_window=window if window and window < max_position else None, rope_scaling=scaling,
        )


def rope_factor(rope: dict[str, Any], where: str = "config.rope_parameters") -> float:
    """How much a RoPE config's positions are scaled down: 1 for the default, the factor of linear scaling
    (transformers' "linear": its angles are the default's divided by it); other types are refused."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return 1.0
    if rope_type != "linear":
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported yet")
    factor = rope.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor >= 1:
        raise ValueError(f"{where}: linear scaling needs a factor >= 1, got {factor!r}")
    return float(factor)


# The dtypes kvpool's fused norm, rotary and SiLU-and-multiply kernels take (kvpool.runner.kernels).
FUSED_DTYPES = (torch.bfloat16, torch.float32)


class PackedLinear(nn.Module):
    """A linear layer whose weight is packed once, at load, for the kernel that runs it on the CPU.

    oneDNN's blocked layout (bf16 or fp32): F.linear reorders a bf16 weight on every call, and runs fp32
    through MKL, which on an AVX2-only AMD EPYC (Zen 3) took 66 ms for SmolLM2's vocabulary projection of a
    64-row decode step where oneDNN's packed fp32 kernel took 32. Used on the CPU wherever oneDNN packs the
    model's dtype.

    bf16 on a CPU with AVX-512 BF16: oneDNN's kernel where it gives each row the same bits whatever the row
    count (checked once per shape at load: `invariant.rows_invariant`), else kvpool's own
    (`kernels/linear_bf16.cpp`, invariant by construction): on an Intel Xeon with AMX, oneDNN's vocabulary
    projection summed 24-256 rows in another order than fewer, so prefix hits and chunking changed bf16 tokens.
    KVPOOL_BF16_LINEAR=kvpool or =onednn forces either. On a 2-core Zen 4 kvpool's kernel made SmolLM2's
    decode-heavy bench ~4% faster (64-row steps: oneDNN splits the narrow projections unevenly over the
    threads) and its prompt-heavy default shape ~2% slower (oneDNN is a little faster at thousands of rows):
    a trade, so oneDNN stays the default where it is invariant (docs/benchmarks.md, session 24).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, native: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # `native` False (the engine's native_kernels=False): torch's own kernels only, oneDNN's here.
        choice = _bf16_linear_choice() if native and weight.dtype == torch.bfloat16 else "onednn"
        self.own = choice == "kvpool"
        w = weight.detach()
        self.register_buffer("packed", self._pack(w), persistent=False)
        self.bias = bias
        if choice == "auto" and not rows_invariant(self, w.shape[1], w.dtype,
                                                   key=("onednn", *w.shape, bias is not None), persist=True):
            log.info("oneDNN's bf16 linear of shape %s is not row-count invariant on this CPU: kvpool's kernel "
                     "runs it", tuple(w.shape))
            self.own = True
            self.packed = self._pack(w)

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvpool.pack_linear_bf16(w) if self.own else torch.ops.mkldnn._reorder_linear_weight(w, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own:
            return torch.ops.kvpool.linear_bf16(x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _bf16_linear_choice() -> str:
    """Which kernel runs bf16 linear layers: "kvpool" or "onednn" (KVPOOL_BF16_LINEAR, or oneDNN's where
    kvpool's kernels cannot run: they need AVX-512 BF16), else "auto" (see PackedLinear)."""
    from kvpool.runner import kernels

    choice = os.environ.get("KVPOOL_BF16_LINEAR", "auto")
    if choice not in ("kvpool", "onednn", "auto"):
        raise ValueError(f"KVPOOL_BF16_LINEAR: {choice!r} is none of 'auto', 'kvpool', 'onednn'")
    return choice if kernels.linear_bf16_supported() else "onednn"


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs on this CPU in `dtype`: bf16 needs AVX-512 (bw, vl, dq) or
    AVX-NE-CONVERT and raises on anything less (an AVX2-only machine), so try it once on a tiny weight."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16, dtype=dtype), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype in (torch.bfloat16, torch.float32) and device.type == "cpu" and _onednn_packs(dtype)


def load_param(params: dict[str, nn.Parameter], target: str, name: str, w: torch.Tensor, loaded: set[str]) -> None:
    """Copy checkpoint tensor `name` into parameter `target` (ValueError if unknown or misshapen)."""
    if target not in params:
        raise ValueError(f"weights: unexpected tensor {name!r}")
    p = params[target]
    if p.shape != w.shape:
        raise ValueError(f"weights: {name!r} has shape {tuple(w.shape)}, expected {tuple(p.shape)}")
    with torch.no_grad():
        p.copy_(w.to(p.dtype))
    loaded.add(target)


def check_all_loaded(params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"weights: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused: Any = None  # torch.ops.kvpool when the runner turns kvpool's compiled kernels on

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in fp32, as transformers computes it whatever the model dtype."""
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dtype == self.weight.dtype and x.dtype in FUSED_DTYPES and x.is_contiguous():
            return self.fused.rms_norm(x, self.weight, self.eps, torch.empty_like(x))
        return self.weight * self.normalized(x).to(x.dtype)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float, max_position: int, scaling: float = 1.0) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_position, self.scaling = head_dim, theta, max_position, scaling
        self.fused: Any = None  # as RMSNorm.fused
        self.reset()

    def reset(self) -> None:
        """(Re)compute the angle tables (a model built on the meta device has none)."""
        head_dim, theta, max_position = self.head_dim, self.theta, self.max_position
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.scaling != 1.0:
            inv = inv / self.scaling  # (linear scaling, as transformers divides its inverse frequencies)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, head_dim), rotated by half (the Hugging Face convention)."""
        if self.fused is not None and x.dtype in FUSED_DTYPES and x.stride(-1) == 1:
            return self.fused.rotary(x, positions, self.cos, self.sin, torch.empty(x.shape, dtype=x.dtype))
        cos = self.cos[positions].to(x.dtype)[:, None, :]
        sin = self.sin[positions].to(x.dtype)[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArch) -> None:
        super().__init__()
        self.a = a
        self.q_size = a.num_heads * a.head_dim
        self.kv_size = a.num_kv_heads * a.head_dim
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=a.o_bias)
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.scale = a.head_dim ** -0.5
        self.fused: Any = None  # as RMSNorm.fused

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        a = self.a
        h = self.input_layernorm(x)
        qkv = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        q = rotary(q.view(t, a.num_heads, a.head_dim), positions)
        k = rotary(k.view(t, a.num_kv_heads, a.head_dim), positions)
        v = v.reshape(t, a.num_kv_heads, a.head_dim)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        x = x + self.o_proj(o.reshape(t, self.q_size))
        h = self.post_attention_layernorm(x)
        gate_up = self.gate_up_proj(h)
        if self.fused is not None and gate_up.dtype in FUSED_DTYPES and gate_up.is_contiguous():
            act = self.fused.silu_and_mul(gate_up, gate_up.new_empty(t, gate_up.shape[-1] // 2))
            return x + self.down_proj(act)
        gate, up = gate_up.chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


@register_model("llama", "mistral", "qwen2", arch=LlamaArch)
class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.max_position, arch.rope_scaling)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size,
                                                                        bias=False)
        self.packed_lm_head: PackedLinear | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata | list[AttentionMetadata],
                inputs_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                capture: dict[str, torch.Tensor] | None = None, capture_layers: Sequence[int] = ()
                ) -> torch.Tensor:
        """`meta`: one for all layers, or one per layer (each layer's KV cache group has its own).
        `inputs_embeds` = (rows, embeddings) replaces the token embeddings of those rows (image features,
        a previous stage's outputs); `capture` receives `layer_{i}`, the residual stream after layer i,
        for each i in `capture_layers`."""
        x = self.embed_tokens(input_ids)
        return self.norm(self.run_layers(x, positions, kv_caches, meta, inputs_embeds, capture, capture_layers))

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   meta: AttentionMetadata | list[AttentionMetadata],
                   inputs_embeds: tuple[torch.Tensor, torch.Tensor] | None,
                   capture: dict[str, torch.Tensor] | None, capture_layers: Sequence[int]) -> torch.Tensor:
        if inputs_embeds is not None:
            rows, embeds = inputs_embeds
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        for i, (layer, kv, m) in enumerate(zip(self.layers, kv_caches, metas, strict=True)):
            x = layer(x, positions, self.rotary_for(layer), kv, m)
            if capture is not None and i in capture_layers:
                capture[f"layer_{i}"] = x
        return x

    def rotary_for(self, layer: nn.Module) -> Rotary:
        return self.rotary

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection in the model's dtype."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.raw_logits(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor, argmax_rows: Any = None) -> torch.Tensor:
        """argmax of compute_logits, ties to the lowest id. `argmax_rows` (kvpool's compiled op): read bf16 or
        fp32 logits in place, in vectors (bf16 without widening: exact, since widening changes no value).
        Models that transform their logits (softcapping) override this."""
        raw = self.raw_logits(hidden)
        if argmax_rows is not None and raw.dtype in (torch.bfloat16, torch.float32) and raw.is_contiguous():
            return argmax_rows(raw)
        return raw.float().argmax(dim=-1)

    def pack_linears(self, native: bool = True) -> None:
        """Swap every projection for its packed form (on the CPU; `native`: see PackedLinear); the weights stay
        as loaded."""
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                lin = getattr(layer, name)
                setattr(layer, name, PackedLinear(lin.weight, lin.bias, native))
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_lm_head = PackedLinear(w, None, native)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        for name, w in weights:
            name = name.removeprefix("model.")
            if name.startswith("lm_head.") and self.lm_head is None:
                continue  # tied: the embedding serves
            parts = name.split(".")
            target = name
            if len(parts) >= 4 and parts[-2] in fused:
                base, idx = fused[parts[-2]]
                target = ".".join([*parts[:2], base, parts[-1]])
                slot = pending.setdefault(target, {})
                slot[str(idx)] = w
                n_parts = 3 if base == "qkv_proj" else 2
                if len(slot) < n_parts:
                    continue
                w = torch.cat([slot[str(i)] for i in range(n_parts)], dim=0)
                del pending[target]
            target = target.replace("self_attn.", "").replace("mlp.", "")
            load_param(params, target, name, w, loaded)
        check_all_loaded(params, loaded)
