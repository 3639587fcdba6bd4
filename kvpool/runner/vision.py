"""A small random-weight vision tower: SigLIP's vision transformer (from a transformers config) plus a
linear projector into a language model's hidden size. Seeded, so every process builds the same weights.

It stands in for a real vision encoder: what kvpool exercises is the plumbing around one (content
hashes in block hashes, embeddings replacing placeholder tokens, the encoder cache), not what it sees.
"""

from __future__ import annotations

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

    def check(self, pixels: torch.Tensor) -> None:
        want = (3, self.image_size, self.image_size)
        if tuple(pixels.shape) != want:
            raise ValueError(f"images: expected pixel shape {want}, got {tuple(pixels.shape)}")

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        self.check(pixels)
        feats = self.tower(pixel_values=pixels[None].float()).last_hidden_state[0]
        return self.proj(feats)
