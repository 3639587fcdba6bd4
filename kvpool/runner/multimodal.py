"""Multimodal inputs of a request: images through a vision encoder (with its cache), or ready embeddings.

Each input occupies `length` placeholder tokens of the prompt from `offset`; its embeddings replace
those tokens' embeddings in the forward. Its content hash (over dtype, shape and bytes) and offset go
into the hash of every block it overlaps (`MultiModalItem`), so the same placeholder tokens with
different content never hit each other's blocks. Encoder outputs are kept in an `EncoderCache` keyed
by the content hash, so a chunk that needs part of an image already seen (a straddling image after a
partial prefix hit, a later prefill chunk, another request) does not run the encoder again.

`EmbedsInput` carries embeddings computed elsewhere (a previous pipeline stage's outputs): no
encoder, same hashing and placement.

`InputProcessor` is what the engine sees of a model's inputs: each model registers its own (see
`kvpool.runner.models.registry`); `MultiModalProcessor` (placeholder embeddings) is the default.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from kvpool.core.request import MultiModalItem
from kvpool.runner.encoder_cache import EncoderCache


@dataclass(frozen=True)
class ImageInput:
    """An image (3, H, W) float array or tensor, or a `.npy` file holding one, at prompt position `offset`."""

    offset: int
    pixels: torch.Tensor | np.ndarray | str | Path


def numeric_tensor(value: Any, name: str) -> torch.Tensor:
    """A CPU tensor of real numbers from a tensor, an array or nested lists; ValueError naming the field
    (`mm_inputs: {name} ...`) otherwise."""
    if isinstance(value, torch.Tensor) and (value.layout != torch.strided or value.is_meta):
        raise ValueError(f"mm_inputs: {name} must be a dense tensor holding its values, got one with layout "
                         f"{value.layout} on {value.device}")
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"mm_inputs: {name} must be an array of numbers: {e}") from None
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"mm_inputs: {name} must be an array of numbers, got dtype {t.dtype}")
    # A copy the request owns: the caller may reuse its buffer once the request is made, and what the
    # request was hashed under (its blocks, its encoder-cache entry) must be what it computes from.
    return t.detach().to("cpu", copy=True)


def finite(t: torch.Tensor, name: str) -> torch.Tensor:
    """`t`, if every value is finite: a NaN or inf reaches the hidden states, and every logit of the
    request is NaN (a sampled one then fails the whole step)."""
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"mm_inputs: {name} must be finite (NaN or inf found)")
    return t


@dataclass(frozen=True)
class EmbedsInput:
    """Ready embeddings (n, hidden_size) for the n prompt tokens from `offset`."""

    offset: int
    embeds: torch.Tensor


@dataclass(frozen=True)
class TiledImageInput:
    """An image for a cross-attention model (Mllama), as its image processor outputs it: `pixel_values`
    (max_num_tiles, 3, H, W), `aspect_ratio_id` (the tiling's index, from 1, in the model's supported aspect
    ratios) and `aspect_ratio_mask` (max_num_tiles,), 1 for the image's tiles and 0 for padding tiles. Its
    place in the prompt is the model's image token; see kvpool.runner.models.mllama."""

    pixel_values: torch.Tensor | np.ndarray
    aspect_ratio_id: int
    aspect_ratio_mask: torch.Tensor | np.ndarray | Sequence[int]


MMInput = ImageInput | EmbedsInput | TiledImageInput


def _described(label: str, t: torch.Tensor) -> tuple[bytes, bytes]:
    """A tensor as what a digest of it reads: `label`, its dtype and shape, then its bytes."""
    a = t.detach().to("cpu").contiguous()
    return (f"{label}|{a.dtype}|{tuple(a.shape)}|".encode(),
            a.view(torch.uint8).numpy().tobytes() if a.numel() else b"")


def content_hash(kind: str, t: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and bytes: equal content, equal hash, in any process."""
    head, data = _described(kind, t)
    h = hashlib.sha256(head)
    h.update(data)
    return h.hexdigest()


def encoder_identity(encoder: nn.Module) -> str:
    """A digest of what a vision encoder computes with: its class and every parameter and buffer (names,
    dtypes, shapes, bytes). An image's key carries it, so KV computed from another tower's embeddings of
    the same pixels (another replica sharing a store, a restart with new encoder weights) is never a hit."""
    import xxhash

    cls = type(encoder)
    h = xxhash.xxh3_128(f"{cls.__module__}.{cls.__qualname__}|".encode())
    for name, t in encoder.state_dict().items():
        for part in _described(name, t):
            h.update(part)
    return h.hexdigest()


def salted_item(item: MultiModalItem, salt: str) -> MultiModalItem:
    """The item under a tenant's cache salt: another hash, so caches keyed by it are not shared across salts."""
    digest = hashlib.sha256(f"salt|{len(salt)}|{salt}|{item.content_hash}".encode()).hexdigest()
    return MultiModalItem(digest, item.offset, item.length)


@dataclass
class PreparedInputs:
    """A request's validated multimodal inputs, as a processor's `prepare_request` returns them."""

    items: list[MultiModalItem]  # what the request's block hashes see
    data: Any  # the processor's own record of the inputs (placed inputs, an image)
    num_encoder_tokens: int = 0  # slots of the request's cross-attention block tables (0: none)


class InputProcessor(Protocol):
    """A model's multimodal inputs: validated and hashed when a request is made, handed to the runner per step."""

    cache: EncoderCache
    encoder_runs: int

    def prepare_request(self, token_ids: Sequence[int], mm_inputs: Sequence[Any],
                        mm_items: Sequence[MultiModalItem], cache_salt: str | None = None) -> PreparedInputs | None:
        """Validate and hash a request's inputs (None when it has none); ValueError naming the field. Under a
        `cache_salt` the inputs' hashes are salted (see `salted_item`)."""
        ...

    def step_inputs(self, step: Any, num_preemptions: int, prepared: PreparedInputs, start: int, end: int) -> None:
        """Set the inputs of positions [start, end) on the request's `SeqStep` of this step."""
        ...

    def forget(self, request_id: str) -> None:
        """The request is finished or aborted."""
        ...


@dataclass
class PlacedInput:
    item: MultiModalItem  # content hash, offset, length: what the block hashes see
    kind: str  # "image" | "embeds"
    data: torch.Tensor  # pixels or embeddings


def load_npy(path: str | Path) -> np.ndarray:
    """The array in a `.npy` file; ValueError naming `mm_inputs` for anything else. numpy raises its own errors
    (EOFError for an empty file, ValueError in its own words for a truncated one or a bad header) and would open
    an `.npz` archive (a handle holding the file open) or unpickle objects: none of that is an image."""
    name = str(path)
    if not Path(path).is_file():
        raise ValueError(f"mm_inputs: image file {name!r} not found")
    try:
        with open(path, "rb") as f:  # (closed whatever np.load finds in it)
            arr = np.load(f, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"mm_inputs: image file {name!r} is not a readable .npy array ({e})") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive (it reads lazily: close its handle on the file too)
        arr.close()
        raise ValueError(f"mm_inputs: image file {name!r} is not a readable .npy array (an .npz archive; save "
                         f"the one array with np.save)")
    return arr


class MultiModalProcessor:
    """Placeholder embeddings: each input replaces the embeddings of its placeholder tokens (the default
    `InputProcessor`)."""

    def __init__(self, hidden_size: int, encoder: nn.Module | None = None, cache_bytes: int = 256 << 20,
                 cache: EncoderCache | None = None) -> None:
        self.hidden_size = hidden_size
        self.encoder = encoder
        self.encoder_id = ""
        if encoder is not None:
            if not isinstance(encoder, nn.Module) or not callable(getattr(encoder, "check", None)) \
                    or not isinstance(getattr(encoder, "num_tokens", None), int):
                raise ValueError(f"vision_encoder: expected an nn.Module with check(pixels) and num_tokens (see "
                                 f"kvpool.runner.vision), got {type(encoder).__name__}")
            if getattr(encoder, "out_dim", hidden_size) != hidden_size:
                raise ValueError(f"vision_encoder: outputs {encoder.out_dim} features; the model's hidden size "
                                 f"is {hidden_size}")
            self.encoder_id = encoder_identity(encoder)
        self.cache = cache if cache is not None else EncoderCache(cache_bytes)
        self.encoder_runs = 0

    def prepare_request(self, token_ids: Sequence[int], mm_inputs: Sequence[MMInput],
                        mm_items: Sequence[MultiModalItem], cache_salt: str | None = None) -> PreparedInputs | None:
        if mm_items:
            # Hashes without content: the placeholder tokens' KV would be computed from their plain embeddings
            # and cached under the items' hashes, where a later request with the real content would hit it.
            raise ValueError("mm_items: give the inputs themselves (mm_inputs); their hashes are computed from them")
        if not mm_inputs:
            return None
        placed = self.prepare(mm_inputs, len(token_ids))
        if cache_salt is not None:
            # The encoder cache is keyed by the inputs' hashes: salted, one tenant's image never serves another's
            # (no timing probe through the encoder cache, as none through the prefix cache).
            for p in placed:
                p.item = salted_item(p.item, cache_salt)
        return PreparedInputs([p.item for p in placed], placed)

    def step_inputs(self, step: Any, num_preemptions: int, prepared: PreparedInputs, start: int, end: int) -> None:
        step.embeds = self.embeddings(prepared.data, start, end)

    def forget(self, request_id: str) -> None:
        pass  # nothing kept per request

    def prepare(self, inputs: Sequence[MMInput], num_prompt_tokens: int) -> list[PlacedInput]:
        """Validate, load and hash a request's inputs; raises ValueError naming the field."""
        placed: list[PlacedInput] = []
        for x in inputs:
            if isinstance(x, ImageInput):
                if self.encoder is None:
                    raise ValueError("mm_inputs: this engine has no vision encoder (set vision_encoder)")
                pixels = x.pixels
                if isinstance(pixels, str | Path):
                    pixels = load_npy(pixels)
                data = finite(numeric_tensor(pixels, "image pixels").float(), "image pixels")
                self.encoder.check(data)  # type: ignore[operator]
                kind, length = "image", int(self.encoder.num_tokens)  # type: ignore[arg-type]
            elif isinstance(x, EmbedsInput):
                data = numeric_tensor(x.embeds, "embeddings")
                data = finite(data if data.is_floating_point() else data.float(), "embeddings")
                if data.ndim != 2 or data.shape[0] < 1 or data.shape[1] != self.hidden_size:
                    raise ValueError(f"mm_inputs: embeddings must be (n >= 1, {self.hidden_size}), got "
                                     f"{tuple(data.shape)}")
                kind, length = "embeds", int(data.shape[0])
            else:
                raise ValueError(f"mm_inputs: expected ImageInput or EmbedsInput, got {type(x).__name__}")
            if isinstance(x.offset, bool) or not isinstance(x.offset, int):
                raise ValueError(f"mm_inputs: {kind} offset must be an int, got {x.offset!r}")
            if x.offset < 0 or x.offset + length > num_prompt_tokens:
                raise ValueError(f"mm_inputs: {kind} at offset {x.offset} needs {length} placeholder tokens; the "
                                 f"prompt has {num_prompt_tokens}")
            # An image's key names the encoder too: its embeddings, not only the pixels, make the KV.
            key = content_hash(kind if kind == "embeds" else f"image|{self.encoder_id}", data)
            placed.append(PlacedInput(MultiModalItem(key, x.offset, length), kind, data))
        placed.sort(key=lambda p: p.item.offset)
        for a, b in itertools.pairwise(placed):
            if a.item.offset + a.item.length > b.item.offset:
                raise ValueError(f"mm_inputs: inputs at offsets {a.item.offset} and {b.item.offset} overlap")
        return placed

    def encode(self, p: PlacedInput) -> torch.Tensor:
        """The input's embeddings, from the encoder cache when it holds them."""
        if p.kind == "embeds":
            return p.data
        out = self.cache.get(p.item.content_hash)
        if out is None:
            assert self.encoder is not None
            out = self.encoder(p.data)
            self.encoder_runs += 1
            self.cache.put(p.item.content_hash, out)
        return out

    def embeddings(self, placed: Sequence[PlacedInput], start: int, end: int
                   ) -> tuple[list[int], torch.Tensor] | None:
        """Rows (relative to `start`) and embeddings of the input tokens among positions [start, end)."""
        rows: list[int] = []
        chunks: list[torch.Tensor] = []
        for p in placed:
            lo, hi = max(start, p.item.offset), min(end, p.item.offset + p.item.length)
            if lo >= hi:
                continue  # this input lies wholly in a prefix hit or a later chunk: no encoder run
            emb = self.encode(p)
            rows.extend(range(lo - start, hi - start))
            chunks.append(emb[lo - p.item.offset:hi - p.item.offset])
        if not rows:
            return None
        return rows, torch.cat(chunks)
