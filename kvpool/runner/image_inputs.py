"""Decoded images (Pillow) into a model's multimodal inputs, by the model's own transformers image processor.

The Python API takes images already preprocessed (`TiledImageInput`: tiles' pixel values, aspect ratio id
and mask, as `MllamaImageProcessor` outputs them). Clients of the HTTP API send pictures; this module runs the
processor saved with the model (`preprocessor_config.json`, loaded by `AutoImageProcessor`) so both paths
feed the engine the same tensors, and the engine hashes those tensors by content for its prefix and encoder
caches (kvpool.runner.multimodal.content_hash), wherever they came from.

It also knows the model's image token (the text that marks an image's place in the prompt) and how many
images a request may hold, so the server can render a chat with images and refuse what the model cannot take.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool.runner.multimodal import MMInput, TiledImageInput

log = logging.getLogger(__name__)


@dataclass
class ImageInputs:
    """A cross-attention model's (Mllama's) image preprocessing: one image per request, tiled."""

    processor: Any  # a transformers image processor (MllamaImageProcessor)
    image_token: str  # the prompt text of the image token ("<|image|>")
    image_token_id: int
    max_images: int = 1  # kvpool's cross-attention path takes one image per request

    @classmethod
    def load(cls, model_dir: Path, image_token_id: int, tokenizer: Any) -> ImageInputs | None:
        """The model's image preprocessing, or None when the folder has no image processor (or no tokenizer to
        name the image token): such an engine takes images only as tensors, through the Python API."""
        if tokenizer is None or not (model_dir / "preprocessor_config.json").is_file():
            return None
        import warnings

        from transformers import AutoImageProcessor

        with warnings.catch_warnings(), _quiet_transformers():
            warnings.simplefilter("ignore")
            processor = AutoImageProcessor.from_pretrained(str(model_dir))
        token = tokenizer.convert_ids_to_tokens(image_token_id)
        if not isinstance(token, str):
            log.warning("%s: the tokenizer has no token for image token id %d; images over HTTP are off",
                        model_dir, image_token_id)
            return None
        return cls(processor, token, image_token_id)

    def process(self, images: Sequence[Any]) -> list[MMInput]:
        """`TiledImageInput`s of PIL images, in order; raises ValueError when the processor refuses one."""
        out: list[MMInput] = []
        for img in images:
            try:
                feats = self.processor(images=[[img]], return_tensors="pt")
            except Exception as e:  # the processor's own checks (mode, channels, size) in its own words
                raise ValueError(f"the image processor refused the image: {e}") from None
            pixels: torch.Tensor = feats["pixel_values"][0, 0]
            out.append(TiledImageInput(pixels, int(feats["aspect_ratio_ids"][0, 0]),
                                       feats["aspect_ratio_mask"][0, 0]))
        return out


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' logger (e.g. its notice that the PIL backend stands in for torchvision's)."""
    from transformers.utils import logging as tlog

    level = tlog.get_verbosity()
    tlog.set_verbosity_error()
    try:
        yield
    finally:
        tlog.set_verbosity(level)
