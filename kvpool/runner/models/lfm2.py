"""LFM2 over the paged KV cache: gated short-convolution layers mixed with GQA attention layers.

A conv layer projects its input to (B, C, x), convolves B * x causally over the last `conv_L_cache`
positions (depthwise), gates the result by C and projects it out. Its state is the last L - 1 inputs of
the convolution: a fixed-size tensor per request, kept in the Mamba group's pages (see
`kvpool.runner.state_cache`) and read back when a chunk, a decode step or a later request sharing the
prefix continues. Attention layers are Llama's with q and k RMS-normalised per head before the rotation
and go through `paged_attention`. The final norm is `embedding_norm`; embeddings are tied by default.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.runner.attention import AttentionMetadata, paged_attention
from kvpool.runner.models.llama import (
    LlamaArch,
    LlamaForCausalLM,
    PackedLinear,
    RMSNorm,
    Rotary,
    check_all_loaded,
    load_param,
    rope_factor,
)
from kvpool.runner.models.registry import register_model
from kvpool.runner.state_cache import StateMetadata, run_conv_state


@dataclass(frozen=True)
class Lfm2Arch(LlamaArch):
    layer_types: tuple[str, ...] = ()
    conv_L_cache: int = 3
    conv_bias: bool = False

    @property
    def layer_windows(self) -> list[int | None]:
        return [None] * self.num_layers

    @property
    def layer_state_shapes(self) -> list[tuple[tuple[int, ...], ...] | None]:
        """Per layer: the shapes of its recurrent state (None for attention layers)."""
        return [((self.hidden_size, self.conv_L_cache - 1),) if t == "conv" else None for t in self.layer_types]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Lfm2Arch:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        scaling = rope_factor(rope)
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None:
            full = set(cfg.get("full_attn_idxs") or range(n))
            types = ["full_attention" if i in full else "conv" for i in range(n)]
        if len(types) != n:
            raise ValueError(f"config.layer_types: {len(types)} entries for {n} layers")
        unknown = sorted(set(types) - {"conv", "full_attention"})
        if unknown:
            raise ValueError(f"config.layer_types: unknown layer types {unknown}")
        if "conv" not in types:
            raise ValueError("config.layer_types: an LFM2 model needs at least one conv layer")
        conv_l = cfg.get("conv_L_cache", 3)
        if not isinstance(conv_l, int) or conv_l < 2:
            raise ValueError(f"config.conv_L_cache: must be an int >= 2, got {conv_l!r}")
        # The feed-forward width as transformers derives it (Lfm2MLP).
        inter = cfg["intermediate_size"]
        if cfg.get("block_auto_adjust_ff_dim", True):
            inter = int(2 * inter / 3)
            mult = cfg.get("block_ffn_dim_multiplier", 1.0)
            if mult is not None:
                m = cfg.get("block_multiple_of", 256)
                inter = m * ((int(mult * inter) + m - 1) // m)
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=inter,
            num_layers=n, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("norm_eps", 1e-5),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
            max_position=cfg.get("max_position_embeddings", 128_000),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            layer_types=tuple(types), conv_L_cache=conv_l, conv_bias=bool(cfg.get("conv_bias", False)),
            rope_scaling=scaling)


class Lfm2MLP(nn.Module):
    def __init__(self, a: Lfm2Arch) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.w3 = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.w2 = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2Attention(nn.Module):
    def __init__(self, a: Lfm2Arch) -> None:
        super().__init__()
        self.a = a
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.out_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_layernorm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_layernorm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.scale = a.head_dim ** -0.5

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        a = self.a
        t = h.shape[0]
        q = rotary(self.q_layernorm(self.q_proj(h).view(t, a.num_heads, a.head_dim)), positions)
        k = rotary(self.k_layernorm(self.k_proj(h).view(t, a.num_kv_heads, a.head_dim)), positions)
        v = self.v_proj(h).view(t, a.num_kv_heads, a.head_dim)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.out_proj(o.reshape(t, a.num_heads * a.head_dim))


class Lfm2ShortConv(nn.Module):
    def __init__(self, a: Lfm2Arch) -> None:
        super().__init__()
        self.hidden = a.hidden_size
        # Depthwise: one filter of conv_L_cache taps per channel (the checkpoint's (H, 1, L) weight).
        self.conv = nn.Conv1d(a.hidden_size, a.hidden_size, a.conv_L_cache, groups=a.hidden_size, bias=a.conv_bias)
        self.in_proj = nn.Linear(a.hidden_size, 3 * a.hidden_size, bias=a.conv_bias)
        self.out_proj = nn.Linear(a.hidden_size, a.hidden_size, bias=a.conv_bias)

    def forward(self, h: torch.Tensor, state: tuple[torch.Tensor], meta: StateMetadata) -> torch.Tensor:
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        y = run_conv_state(b * x, self.conv.weight[:, 0, :], self.conv.bias, state[0], meta)
        return self.out_proj(c * y)


class Lfm2Layer(nn.Module):
    def __init__(self, a: Lfm2Arch, kind: str) -> None:
        super().__init__()
        self.is_attention = kind != "conv"
        if self.is_attention:
            self.self_attn = Lfm2Attention(a)
        else:
            self.conv = Lfm2ShortConv(a)
        self.feed_forward = Lfm2MLP(a)
        self.operator_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.ffn_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, cache: Any, meta: Any) -> torch.Tensor:
        h = self.operator_norm(x)
        if self.is_attention:
            x = x + self.self_attn(h, positions, rotary, cache, meta)
        else:
            x = x + self.conv(h, cache, meta)
        return x + self.feed_forward(self.ffn_norm(x))


@register_model("lfm2", arch=Lfm2Arch)
class Lfm2ForCausalLM(LlamaForCausalLM):
    """Shares Llama's forward loop (embeddings, layers, final norm) and logits; own layers and weights."""

    def __init__(self, arch: Lfm2Arch) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Lfm2Layer(arch, t) for t in arch.layer_types)
        self.embedding_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.max_position, arch.rope_scaling)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size,
                                                                        bias=False)
        self.packed_lm_head = None

    @property
    def norm(self) -> RMSNorm:  # type: ignore[override]
        return self.embedding_norm

    def pack_linears(self, native: bool = True) -> None:
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and module is not self:
                    setattr(module, name, PackedLinear(child.weight, child.bias, native))
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_lm_head = PackedLinear(w, None, native)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face names map one to one onto this module's (no fused projections)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            name = name.removeprefix("model.")
            if name.startswith("lm_head.") and self.lm_head is None:
                continue  # tied: the embedding serves
            load_param(params, name, name, w, loaded)
        check_all_loaded(params, loaded)
