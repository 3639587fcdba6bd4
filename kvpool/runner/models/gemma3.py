"""Gemma-3 (text) over the paged KV cache: five sliding-window layers per full-attention layer.

What differs from Llama: RMSNorm scales by (1 + weight); q and k are RMS-normalised per head before
the rotation; each layer norms its attention and MLP outputs again before the residual ("sandwich"
norms); the MLP is GELU(tanh)-gated; embeddings are scaled by sqrt(hidden size); the attention scale
is query_pre_attn_scalar ** -0.5; sliding layers rotate with their own RoPE base. The sliding layers'
KV lives in their own cache groups, which keep only the window's blocks (see LayerLayout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.runner.attention import AttentionMetadata, paged_attention
from kvpool.runner.models.llama import LlamaArch, LlamaForCausalLM, RMSNorm, Rotary, rope_factor
from kvpool.runner.models.registry import register_model


@dataclass(frozen=True)
class Gemma3Arch(LlamaArch):
    query_pre_attn_scalar: float = 256.0
    rope_local_theta: float = 10000.0
    layer_types: tuple[str, ...] = ()
    window: int = 512
    final_logit_softcapping: float | None = None

    @property
    def layer_windows(self) -> list[int | None]:
        return [self.window if t == "sliding_attention" else None for t in self.layer_types]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Gemma3Arch:
        act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"config.hidden_activation: {act!r} is not supported (gelu_pytorch_tanh only)")
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("config.attn_logit_softcapping: attention soft-capping is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("config.use_bidirectional_attention: only causal attention is supported")
        rope = cfg.get("rope_parameters") or {}
        # transformers 5 writes each layer type's RoPE under rope_parameters; older configs a
        # `rope_scaling` for the full-attention layers (Gemma-3 4B and up: linear, factor 8), the sliding
        # ones keeping the default.
        full = rope.get("full_attention") or cfg.get("rope_scaling") or {}
        local = rope.get("sliding_attention", {})
        scaling = rope_factor(full)
        if rope_factor(local, "config.rope_parameters.sliding_attention") != 1.0:
            raise ValueError("config.rope_parameters.sliding_attention: scaled RoPE is not supported there")
        n = cfg["num_hidden_layers"]
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                           for i in range(n)]
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_layers=n, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
            max_position=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
            layer_types=tuple(types), window=int(cfg.get("sliding_window") or 512), rope_scaling=scaling,
            final_logit_softcapping=cfg.get("final_logit_softcapping"))


class GemmaRMSNorm(RMSNorm):
    """Scales by (1 + weight), in fp32 before casting back: the order transformers uses for Gemma."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Layer(nn.Module):
    def __init__(self, a: Gemma3Arch, sliding: bool) -> None:
        super().__init__()
        self.a = a
        self.sliding = sliding
        self.q_size = a.num_heads * a.head_dim
        self.kv_size = a.num_kv_heads * a.head_dim
        eps = a.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(a.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(a.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(a.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(a.hidden_size, eps)
        self.q_norm = GemmaRMSNorm(a.head_dim, eps)
        self.k_norm = GemmaRMSNorm(a.head_dim, eps)
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=a.attention_bias)
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.scale = a.query_pre_attn_scalar ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        a = self.a
        t = x.shape[0]
        q, k, v = self.qkv_proj(self.input_layernorm(x)).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = rotary(self.q_norm(q.view(t, a.num_heads, a.head_dim)), positions)
        k = rotary(self.k_norm(k.view(t, a.num_kv_heads, a.head_dim)), positions)
        o = paged_attention(q, k, v.reshape(t, a.num_kv_heads, a.head_dim), kv[0], kv[1], meta, self.scale)
        x = x + self.post_attention_layernorm(self.o_proj(o.reshape(t, self.q_size)))
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).chunk(2, dim=-1)
        return x + self.post_feedforward_layernorm(self.down_proj(F.gelu(gate, approximate="tanh") * up))


@register_model("gemma3_text", arch=Gemma3Arch)
class Gemma3ForCausalLM(LlamaForCausalLM):
    """Shares Llama's weight loading (q/k/v and gate/up fused), packing and logits."""

    def __init__(self, arch: Gemma3Arch) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Gemma3Layer(arch, t == "sliding_attention") for t in arch.layer_types)
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.max_position, arch.rope_scaling)
        self.rotary_local = Rotary(arch.head_dim, arch.rope_local_theta, arch.max_position)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size,
                                                                        bias=False)
        self.packed_lm_head = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata | list[AttentionMetadata],
                inputs_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                capture: dict[str, torch.Tensor] | None = None, capture_layers: Sequence[int] = ()
                ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.arch.hidden_size ** 0.5, dtype=x.dtype)
        return self.norm(self.run_layers(x, positions, kv_caches, meta, inputs_embeds, capture, capture_layers))

    def rotary_for(self, layer: nn.Module) -> Rotary:
        return self.rotary_local if layer.sliding else self.rotary  # type: ignore[return-value]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping  # type: ignore[attr-defined]
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def greedy_tokens(self, hidden: torch.Tensor, argmax_rows: Any = None) -> torch.Tensor:
        if self.arch.final_logit_softcapping is not None:  # type: ignore[attr-defined]
            # tanh saturates: logits distinct before capping may tie after it, and ties go to the lowest id.
            return self.compute_logits(hidden).argmax(dim=-1)
        return super().greedy_tokens(hidden, argmax_rows)
