"""Mllama (Llama 3.2 Vision): a Llama text decoder whose cross-attention layers read an image's encoder states.

Self-attention layers are Llama's, over the paged cache of their full-attention group. Cross-attention layers
(`cross_attention_layers` in the config) attend to the vision tower's output, projected into the text's hidden
size: their K/V (`k_norm`-ed keys, values) live in the blocks of a cross-attention group, sized by the encoder
tokens (every tile of the image, padding tiles included, as transformers keeps them), written once in the
first step after the request is admitted and read by every later step. Each cross layer is tanh-gated
(attention and MLP) and its MLP output is zeroed for the rows that see no tile (`full_text_row_masked_out_mask`).

Masking follows transformers' `MllamaForConditionalGeneration` exactly: tokens from the image token on see the
image's real tiles; tokens before it have an all-zero mask row, so they attend to every encoder token (their
MLP output alone is zeroed). Text before the image therefore depends on the image too, which is why the
image's content hash goes into the first block's hash (see `MllamaInputs.prepare`). Requests without an
image skip the cross layers, as transformers does.

The vision tower and the projector are transformers' own modules (`MllamaVisionModel`, a linear layer),
loaded from the checkpoint; the encoder states of an image are kept in the engine's encoder cache under its
content hash, so a second request with the same image does not run the tower again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvpool.core.request import MultiModalItem
from kvpool.runner.attention import gather_blocks, write_kv
from kvpool.runner.encoder_cache import EncoderCache
from kvpool.runner.models.llama import (
    DecoderLayer,
    LlamaArch,
    LlamaForCausalLM,
    PackedLinear,
    RMSNorm,
    Rotary,
    check_all_loaded,
    load_param,
)
from kvpool.runner.models.registry import register_model
from kvpool.runner.multimodal import (
    PreparedInputs,
    TiledImageInput,
    content_hash,
    finite,
    numeric_tensor,
    salted_item,
)

# Rows of the embedding table past the text vocabulary: <|image|> and other special tokens (transformers: +8).
EXTRA_EMBEDDINGS = 8


@dataclass(frozen=True)
class MllamaArch(LlamaArch):
    cross_attention_layers: tuple[int, ...] = ()
    image_token_id: int = 128256
    num_embeddings: int = 0  # rows of the embedding table: the text vocabulary plus EXTRA_EMBEDDINGS
    max_num_tiles: int = 4
    num_patches: int = 0  # per tile, the class token included
    image_size: int = 448
    max_aspect_ratio_id: int = 8
    vision_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_encoder_tokens(self) -> int:
        """Encoder tokens of one image: every tile (padding tiles too) times the patches of a tile."""
        return self.max_num_tiles * self.num_patches

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MllamaArch:
        text, vision = cfg.get("text_config"), cfg.get("vision_config")
        if not isinstance(text, dict) or not isinstance(vision, dict):
            raise ValueError("config: an mllama config needs text_config and vision_config")
        base = LlamaArch.from_hf_config(text)
        cross = tuple(sorted(int(i) for i in text.get("cross_attention_layers") or ()))
        if any(not 0 <= i < base.num_layers for i in cross):
            raise ValueError(f"config.text_config.cross_attention_layers: {list(cross)} not all in "
                             f"[0, {base.num_layers})")
        if len(cross) == base.num_layers:
            raise ValueError("config.text_config.cross_attention_layers: every layer is a cross-attention layer")
        image_size, patch = vision.get("image_size", 448), vision.get("patch_size", 14)
        if not isinstance(image_size, int) or not isinstance(patch, int):
            raise ValueError("config.vision_config: only square image_size and patch_size (ints) are supported")
        ratios = vision.get("supported_aspect_ratios") or [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1],
                                                           [4, 1]]
        return cls(**asdict(base), cross_attention_layers=cross,
                   image_token_id=int(cfg.get("image_token_index", 128256)),
                   num_embeddings=base.vocab_size + EXTRA_EMBEDDINGS, max_num_tiles=int(vision.get("max_num_tiles", 4)),
                   num_patches=(image_size // patch) ** 2 + 1, image_size=image_size, max_aspect_ratio_id=len(ratios),
                   vision_config=vision)


@dataclass
class CrossStep:
    """A request's image as one step of the runner sees it (set on `SeqStep.cross`)."""

    num_tokens: int  # encoder tokens: slots of the request's cross-attention block table
    first_row: int  # prompt position of the image token: rows from here on see the image's tiles
    num_visible: int  # leading encoder tokens those rows see (the image's real tiles, tile-major)
    states: torch.Tensor | None = None  # (num_tokens, hidden): encoder states to write this step, else None


@dataclass
class CrossSeq:
    lo: int  # rows of this sequence among the step's image rows (CrossAttentionMetadata.rows)
    hi: int
    num_tokens: int
    block_ids: torch.Tensor
    bias: torch.Tensor | None  # (hi - lo, num_tokens) additive mask, None when every row sees every token


@dataclass
class CrossAttentionMetadata:
    """One cross-attention group's view of a step, planned once and shared by the group's layers."""

    rows: torch.Tensor | None = None  # step rows of the sequences with an image (None: the layers are skipped)
    seqs: list[CrossSeq] = field(default_factory=list)
    row_mask: torch.Tensor | None = None  # (len(rows), 1): 0 for rows seeing no tile (their MLP output is zeroed)
    write_states: torch.Tensor | None = None  # encoder states written this step, and their slots
    write_slots: torch.Tensor | None = None
    # Single-row sequences (decodes), attended in one batched call: their indices into `seqs`, their rows
    # (among `rows`), stacked block tables and biases (None: every row sees every encoder token).
    decode_seqs: frozenset[int] = frozenset()
    decode_rows: torch.Tensor | None = None
    decode_tables: torch.Tensor | None = None
    decode_bias: torch.Tensor | None = None


def plan_cross_attention(steps: Sequence[Any], group: int, block_size: int, dtype: torch.dtype,
                         device: torch.device) -> CrossAttentionMetadata:
    """The cross-attention metadata of KV cache group `group` for a step's `SeqStep`s (in batch order)."""
    meta = CrossAttentionMetadata()
    rows: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    states: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    t = n_rows = 0
    for s in steps:
        n = len(s.token_ids)
        c: CrossStep | None = s.cross
        if c is not None and c.num_tokens > 0:
            need = -(-c.num_tokens // block_size)
            table_ids = s.group_block_ids[group] if s.group_block_ids is not None else s.block_ids
            if len(table_ids) < need:
                raise ValueError(f"{s.req_id}: cross-attention block table holds {len(table_ids)} blocks for "
                                 f"{c.num_tokens} encoder tokens")
            table = torch.tensor(table_ids[:need], dtype=torch.long)
            pos = torch.arange(s.start_pos, s.start_pos + n)
            sees = pos >= c.first_row
            bias = None
            if c.num_visible < c.num_tokens and bool(sees.any()):
                hidden = sees[:, None] & (torch.arange(c.num_tokens)[None, :] >= c.num_visible)
                bias = torch.zeros((n, c.num_tokens), dtype=dtype).masked_fill_(hidden, float("-inf")).to(device)
            meta.seqs.append(CrossSeq(n_rows, n_rows + n, c.num_tokens, table.to(device), bias))
            rows.append(torch.arange(t, t + n))
            masks.append(sees)
            if c.states is not None:
                enc = torch.arange(c.num_tokens)
                states.append(c.states)
                slots.append(table[enc // block_size] * block_size + enc % block_size)
            n_rows += n
        t += n
    if not meta.seqs:
        return meta
    meta.rows = torch.cat(rows).to(device)
    mask = torch.cat(masks)
    if not bool(mask.all()):
        meta.row_mask = mask.to(dtype)[:, None].to(device)
    if states:
        meta.write_states = torch.cat(states).to(device)
        meta.write_slots = torch.cat(slots).to(device)
    decodes = [i for i, x in enumerate(meta.seqs) if x.hi - x.lo == 1]
    # One image size per model, so decodes' tables have one length; batching pays from two sequences on.
    if len(decodes) >= 2 and len({meta.seqs[i].num_tokens for i in decodes}) == 1:
        ds = [meta.seqs[i] for i in decodes]
        meta.decode_seqs = frozenset(decodes)
        meta.decode_rows = torch.tensor([x.lo for x in ds], dtype=torch.long, device=device)
        meta.decode_tables = torch.stack([x.block_ids for x in ds])
        if any(x.bias is not None for x in ds):
            zero = torch.zeros((1, ds[0].num_tokens), dtype=dtype, device=device)
            meta.decode_bias = torch.cat([zero if x.bias is None else x.bias for x in ds])
    return meta


class MllamaCrossLayer(nn.Module):
    """A gated cross-attention decoder layer; its K/V come from the encoder states, not from the text."""

    def __init__(self, a: MllamaArch) -> None:
        super().__init__()
        self.a = a
        self.q_size = a.num_heads * a.head_dim
        self.kv_size = a.num_kv_heads * a.head_dim
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.q_proj = nn.Linear(a.hidden_size, self.q_size, bias=False)
        self.kv_proj = nn.Linear(a.hidden_size, 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))
        self.scale = a.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                kv: tuple[torch.Tensor, torch.Tensor], meta: CrossAttentionMetadata) -> torch.Tensor:
        if meta.rows is None:
            return x  # no sequence of this step has an image: the layer is skipped, as in transformers
        a = self.a
        if meta.write_states is not None:
            k, v = self.kv_proj(meta.write_states.to(x.dtype)).split([self.kv_size, self.kv_size], dim=-1)
            k = self.k_norm(k.reshape(-1, a.num_kv_heads, a.head_dim))
            write_kv(k, v.reshape(-1, a.num_kv_heads, a.head_dim), kv[0], kv[1], meta.write_slots)  # type: ignore[arg-type]
        xs = x.index_select(0, meta.rows)
        n = xs.shape[0]
        q = self.q_norm(self.q_proj(self.input_layernorm(xs)).view(n, a.num_heads, a.head_dim))
        o = torch.empty_like(q)
        if meta.decode_rows is not None:
            tables = meta.decode_tables
            assert tables is not None
            b, n_enc = tables.shape[0], meta.seqs[next(iter(meta.decode_seqs))].num_tokens
            # (kv_heads, b * L, d) -> (b, kv_heads, n_enc, d): each decode's own encoder tokens.
            kk, vv = (gather_blocks(c, tables, q.dtype).view(a.num_kv_heads, b, -1, a.head_dim)[:, :, :n_enc]
                      .transpose(0, 1) for c in kv)
            bias = meta.decode_bias[:, None, None, :] if meta.decode_bias is not None else None
            out = F.scaled_dot_product_attention(q[meta.decode_rows][:, :, None], kk, vv, attn_mask=bias,
                                                 scale=self.scale, enable_gqa=True)
            o[meta.decode_rows] = out[:, :, 0]
        for i, s in enumerate(meta.seqs):
            if i in meta.decode_seqs:
                continue
            kk = gather_blocks(kv[0], s.block_ids, q.dtype)[:, :s.num_tokens]
            vv = gather_blocks(kv[1], s.block_ids, q.dtype)[:, :s.num_tokens]
            out = F.scaled_dot_product_attention(q[s.lo:s.hi].transpose(0, 1)[None], kk[None], vv[None],
                                                 attn_mask=s.bias, scale=self.scale, enable_gqa=True)
            o[s.lo:s.hi] = out[0].transpose(0, 1)
        xs = xs + self.cross_attn_attn_gate.tanh() * self.o_proj(o.reshape(n, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(xs)).chunk(2, dim=-1)
        m = self.down_proj(F.silu(gate) * up)
        if meta.row_mask is not None:
            m = meta.row_mask * m
        xs = xs + self.cross_attn_mlp_gate.tanh() * m
        return x.index_copy(0, meta.rows, xs)


# Checkpoint prefixes (the original layout, and transformers 5's) -> names in this module.
_PREFIXES = (("language_model.model.", ""), ("model.language_model.", ""), ("language_model.lm_head.", "lm_head."),
             ("model.vision_model.", "vision_model."), ("model.multi_modal_projector.", "multi_modal_projector."))
# (sub-module, projection) -> (fused parameter, index, parts): fused at load time, one matmul instead of several.
_FUSED = {("self_attn", "q_proj"): ("qkv_proj", 0, 3), ("self_attn", "k_proj"): ("qkv_proj", 1, 3),
          ("self_attn", "v_proj"): ("qkv_proj", 2, 3), ("cross_attn", "k_proj"): ("kv_proj", 0, 2),
          ("cross_attn", "v_proj"): ("kv_proj", 1, 2), ("mlp", "gate_proj"): ("gate_up_proj", 0, 2),
          ("mlp", "up_proj"): ("gate_up_proj", 1, 2)}


def _mllama_inputs(model: Any, encoder: Any, cache: EncoderCache) -> MllamaInputs:
    if encoder is not None:  # (taking it would leave it unused: every picture goes through the model's tower)
        raise ValueError("vision_encoder: Mllama reads images with its own vision tower (from its weights); "
                         "leave vision_encoder unset")
    return MllamaInputs(model, cache)


@register_model("mllama", arch=MllamaArch, inputs=_mllama_inputs)
class MllamaForConditionalGeneration(LlamaForCausalLM):
    """Shares Llama's forward loop (per-layer metadata), rotary embedding and logits."""

    def __init__(self, arch: MllamaArch) -> None:
        from transformers import MllamaVisionConfig, MllamaVisionModel

        nn.Module.__init__(self)
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.num_embeddings, arch.hidden_size)
        cross = set(arch.cross_attention_layers)
        self.layers = nn.ModuleList(MllamaCrossLayer(arch) if i in cross else DecoderLayer(arch)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.max_position, arch.rope_scaling)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.packed_lm_head = None
        vision = MllamaVisionConfig.from_dict(arch.vision_config)
        self.vision_model = MllamaVisionModel(vision)
        self.multi_modal_projector = nn.Linear(vision.vision_output_dim, arch.hidden_size, bias=True)

    @torch.inference_mode()
    def encode_image(self, pixel_values: torch.Tensor, aspect_ratio_id: int, aspect_ratio_mask: torch.Tensor
                     ) -> torch.Tensor:
        """Encoder states (max_num_tiles * num_patches, hidden) of one image: the tower, then the projector."""
        w = self.multi_modal_projector.weight
        out = self.vision_model(pixel_values=pixel_values[None, None].to(w.device, w.dtype),
                                aspect_ratio_ids=torch.tensor([[aspect_ratio_id]], device=w.device),
                                aspect_ratio_mask=aspect_ratio_mask[None, None].to(w.device)).last_hidden_state
        return self.multi_modal_projector(out).reshape(-1, self.arch.hidden_size)

    def pack_linears(self, native: bool = True) -> None:
        for layer in self.layers:
            names = ("q_proj", "kv_proj") if isinstance(layer, MllamaCrossLayer) else ("qkv_proj",)
            for name in (*names, "o_proj", "gate_up_proj", "down_proj"):
                lin = getattr(layer, name)
                setattr(layer, name, PackedLinear(lin.weight, lin.bias, native))
        assert self.lm_head is not None
        self.packed_lm_head = PackedLinear(self.lm_head.weight, None, native)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a transformers Mllama checkpoint (text, vision tower, projector), fusing projections."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, w in weights:
            target = name
            for old, new in _PREFIXES:
                if name.startswith(old):
                    target = new + name[len(old):]
                    break
            parts = target.split(".")
            if parts[0] == "layers" and len(parts) == 5 and (parts[2], parts[3]) in _FUSED:
                base, idx, n_parts = _FUSED[(parts[2], parts[3])]
                target = f"layers.{parts[1]}.{base}.{parts[4]}"
                slot = pending.setdefault(target, {})
                slot[idx] = w
                if len(slot) < n_parts:
                    continue
                w = torch.cat([slot[i] for i in range(n_parts)], dim=0)
                del pending[target]
            elif parts[0] == "layers" and len(parts) > 3 and parts[2] in ("self_attn", "cross_attn", "mlp"):
                target = ".".join(parts[:2] + parts[3:])
            load_param(params, target, name, w, loaded)
        check_all_loaded(params, loaded)


@dataclass
class PlacedImage:
    """A request's validated image: what its block hashes see, and what the runner needs of it."""

    item: MultiModalItem
    pixel_values: torch.Tensor
    aspect_ratio_id: int
    aspect_ratio_mask: torch.Tensor
    first_row: int  # position of the image token in the prompt
    num_tokens: int  # encoder tokens
    num_visible: int  # encoder tokens of the real tiles


class MllamaInputs:
    """A cross-attention model's images: validation and hashing at request time, encoder states at run time.

    Also remembers, per request, whether its encoder states are in its cross-attention blocks: they are
    written in the first step after each admission (a preempted request lost its blocks; cross-attention
    blocks are never prefix-cached), and only read afterwards.
    """

    def __init__(self, model: MllamaForConditionalGeneration, cache: EncoderCache) -> None:
        self.model = model
        self.arch: MllamaArch = model.arch  # type: ignore[assignment]
        self.cache = cache
        self.encoder_runs = 0
        self._written: dict[str, int] = {}  # request id -> its preemption count when its states were written

    def prepare(self, inputs: Sequence[Any], token_ids: Sequence[int]) -> PlacedImage | None:
        """Validate and hash a request's image (None without one); raises ValueError naming the field."""
        a = self.arch
        if not inputs:
            return None
        if len(inputs) > 1:
            raise ValueError(f"mm_inputs: this model takes at most one image per request, got {len(inputs)}")
        x = inputs[0]
        if not isinstance(x, TiledImageInput):
            raise ValueError(f"mm_inputs: this cross-attention model takes a TiledImageInput (tiles' pixel values, "
                             f"aspect ratio id and mask), got {type(x).__name__}")
        pixels = finite(numeric_tensor(x.pixel_values, "pixel_values").float(), "pixel_values")
        want = (a.max_num_tiles, 3, a.image_size, a.image_size)
        if tuple(pixels.shape) != want:
            raise ValueError(f"mm_inputs: pixel_values must have shape {want}, got {tuple(pixels.shape)}")
        ar_id, top = x.aspect_ratio_id, a.max_aspect_ratio_id
        if not isinstance(ar_id, int | np.integer) or isinstance(ar_id, bool) or not 1 <= ar_id <= top:
            raise ValueError(f"mm_inputs: aspect_ratio_id must be an int in [1, {top}], got {ar_id!r}")
        mask = numeric_tensor(x.aspect_ratio_mask, "aspect_ratio_mask")
        if tuple(mask.shape) != (a.max_num_tiles,) or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"mm_inputs: aspect_ratio_mask must be {a.max_num_tiles} zeros and ones, got "
                             f"{mask.tolist()}")
        num_tiles = int(mask.sum())
        if num_tiles < 1 or not bool((mask[:num_tiles] == 1).all()):
            raise ValueError(f"mm_inputs: aspect_ratio_mask must be ones for the image's tiles, then zeros; got "
                             f"{mask.tolist()}")
        mask = mask.long()
        at = [i for i, t in enumerate(token_ids) if t == a.image_token_id]
        if len(at) != 1:
            raise ValueError(f"mm_inputs: the prompt must hold the image token (id {a.image_token_id}) exactly once "
                             f"for its image; found it {len(at)} times")
        digest = content_hash(f"mllama-image|{int(ar_id)}|{mask.tolist()}", pixels)
        # Every text token sees the image (before the image token through an all-zero mask row), so the image
        # keys the first block and, chained, every block after it.
        return PlacedImage(MultiModalItem(digest, 0, 1), pixels, int(ar_id), mask, at[0], a.num_encoder_tokens,
                           num_tiles * a.num_patches)

    @property
    def image_token_id(self) -> int:
        """The prompt token that marks the image's place (for kvpool.runner.image_inputs)."""
        return self.arch.image_token_id

    def prepare_request(self, token_ids: Sequence[int], mm_inputs: Sequence[Any],
                        mm_items: Sequence[MultiModalItem], cache_salt: str | None = None) -> PreparedInputs | None:
        """`prepare` as an `InputProcessor`: the image's item keys the blocks; its encoder tokens size the
        request's cross-attention block tables."""
        if mm_items:
            raise ValueError("mm_items: a cross-attention model needs the image itself (mm_inputs)")
        image = self.prepare(mm_inputs, token_ids)
        if image is not None and cache_salt is not None:
            image.item = salted_item(image.item, cache_salt)  # (salted as MultiModalProcessor does)
        return PreparedInputs([image.item], image, image.num_tokens) if image is not None else None

    def step_inputs(self, step: Any, num_preemptions: int, prepared: PreparedInputs, start: int, end: int) -> None:
        step.cross = self.step(step.req_id, num_preemptions, prepared.data)

    def states(self, p: PlacedImage) -> torch.Tensor:
        """The image's encoder states, from the encoder cache when it holds them."""
        out = self.cache.get(p.item.content_hash)
        if out is None:
            out = self.model.encode_image(p.pixel_values, p.aspect_ratio_id, p.aspect_ratio_mask)
            self.encoder_runs += 1
            self.cache.put(p.item.content_hash, out)
        return out

    def step(self, request_id: str, num_preemptions: int, p: PlacedImage) -> CrossStep:
        """The request's image for this step: with its states when its blocks do not hold them yet."""
        write = self._written.get(request_id) != num_preemptions
        if write:
            self._written[request_id] = num_preemptions
        return CrossStep(p.num_tokens, p.first_row, p.num_visible, self.states(p) if write else None)

    def forget(self, request_id: str) -> None:
        self._written.pop(request_id, None)
