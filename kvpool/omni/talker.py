"""The reference pipeline's second stage: a small random-weight decoder that turns a thinker's per-token
states into a sequence of integer codes, as a speech-codec stage would.

It is a Llama built from a tiny transformers config with seeded weights and saved once into kvpool's
cache folder, so kvpool's own engine runs it (input embeddings at the prompt's rows, codes as tokens).
Its vocabulary is the codebook. Nothing is downloaded: the weights are generated.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch

from kvpool.runner.model_files import cache_dir

TALKER_CONFIG = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
                     initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def make_talker(path: Path, seed: int = 0, **overrides: object) -> Path:
    """Write the talker (config.json + safetensors) into `path`; the same seed gives the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**TALKER_CONFIG, **overrides}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.save_pretrained(path)
    return path


def default_talker_dir(seed: int = 0) -> Path:
    """The reference talker, generated on first use under kvpool's cache folder, keyed by config and seed and
    by the torch and transformers that generate it (their initialisers and random streams decide the weights:
    after an upgrade, the folder is what this install would make, not an older one's)."""
    import transformers

    made_by = [torch.__version__, transformers.__version__]
    key = hashlib.sha256(json.dumps([TALKER_CONFIG, seed, made_by], sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / f"omni-talker-{key}"
    if not (path / "config.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside, then renamed: a concurrent reader never sees half a model.
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".talker-"))
        make_talker(tmp, seed)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its copy is the same
            shutil.rmtree(tmp, ignore_errors=True)
    return path
