"""A small random-weight vision tower: SigLIP's vision transformer (from a transformers config) plus a
linear projector into a language model's hidden size. Seeded, so every process builds the same weights.

It stands in for a real vision encoder: what kvpool exercises is the plumbing around one (content
hashes in block hashes, embeddings replacing placeholder tokens, the encoder cache), not what it sees.

Its processor (`TinyVisionEncoder.preprocess`) is SigLIP's own, transformers' `SiglipImageProcessorPil` sized to
the tower: the picture converted to RGB, resized to image_size x image_size (bicubic), scaled to [0, 1], then
normalised with mean 0.5 and std 0.5 per channel, so pixel values lie in [-1, 1], laid out (3, H, W) float32.
The HTTP server (`kvpool omni-serve`) and Python callers share it, so the same picture gives the same tensor,
and so the same content hash (prefix and encoder caches), whichever way it came in.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from torch import nn


class TinyVisionEncoder(nn.Module):
    """Images (3, image_size, image_size) -> (num_tokens, out_dim) embeddings, one row per patch."""

    def __init__(self, out_dim: int, *, image_size: int = 8, patch_size: int = 4, hidden_size: int = 32,
                 num_layers: int = 2, num_heads: int = 2, seed: int = 0) -> None:
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        if image_size % patch_size:
            raise ValueError(f"patch_size: {patch_size} does not divide image_size {image_size}")
        cfg = SiglipVisionConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                 num_hidden_layers=num_layers, num_attention_heads=num_heads, image_size=image_size,
                                 patch_size=patch_size, vision_use_head=False)
        # A private RNG state: building the tower must not shift anyone else's random numbers.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tower = SiglipVisionModel(cfg)
            self.proj = nn.Linear(hidden_size, out_dim)
        self.image_size = image_size
        self.num_tokens = (image_size // patch_size) ** 2
        self.out_dim = out_dim
        self.eval()

    @cached_property
    def processor(self) -> Any:
        """SigLIP's image processor (PIL backend: no torchvision needed) at the tower's image size."""
        from transformers import SiglipImageProcessorPil

        return SiglipImageProcessorPil(size={"height": self.image_size, "width": self.image_size})

    def preprocess(self, image: Any) -> torch.Tensor:
        """A PIL image -> the tower's input (3, image_size, image_size) float32 in [-1, 1]; ValueError (in the
        processor's words) when it refuses the image."""
        try:
            pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"][0]
        except Exception as e:  # the processor's own checks (mode, channels) in its own words
            raise ValueError(f"the image processor refused the image: {e}") from None
        return pixels.float().contiguous()

    def check(self, pixels: torch.Tensor) -> None:
        want = (3, self.image_size, self.image_size)
        if tuple(pixels.shape) != want:
            raise ValueError(f"images: expected pixel shape {want}, got {tuple(pixels.shape)}")

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        self.check(pixels)
        feats = self.tower(pixel_values=pixels[None].float()).last_hidden_state[0]
        return self.proj(feats)
