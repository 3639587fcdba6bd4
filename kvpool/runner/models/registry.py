"""The model registry: which model class (and config parser, and input processor) serves a checkpoint.

A model registers itself with `@register_model(*model_types, arch=..., inputs=...)`, keyed by the Hugging Face
config's `model_type` (the architecture family, as transformers' own auto classes key on it). The runner
resolves a config through `resolve_model_class`; nothing else names a model class. `inputs` builds the
model's input processor (how a request's images or embeddings reach the forward, see
`kvpool.runner.multimodal.InputProcessor`): models that read images through cross-attention register their
own, the others get placeholder embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

# (model, vision encoder or None, encoder cache) -> an InputProcessor; see kvpool.runner.multimodal.
InputsFactory = Callable[[nn.Module, Any, Any], Any]


@dataclass(frozen=True)
class ModelEntry:
    model_cls: type[nn.Module]
    arch_cls: type  # has from_hf_config(cfg) -> the arch the model class is built from
    inputs: InputsFactory | None  # None: placeholder embeddings (MultiModalProcessor)


_REGISTRY: dict[str, ModelEntry] = {}


def register_model(*model_types: str, arch: type, inputs: InputsFactory | None = None
                   ) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: serve configs whose `model_type` is one of `model_types` with this class."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        for t in model_types:
            if t in _REGISTRY and _REGISTRY[t].model_cls is not cls:
                raise ValueError(f"model_type {t!r} is already registered to {_REGISTRY[t].model_cls.__name__}")
            _REGISTRY[t] = ModelEntry(cls, arch, inputs)
        return cls

    return wrap


def _load_models() -> None:
    # Importing a model module registers it.
    from kvpool.runner.models import gemma3, lfm2, llama, mllama  # noqa: F401


def supported_model_types() -> list[str]:
    _load_models()
    return sorted(_REGISTRY)


def resolve_model_class(cfg: dict[str, Any]) -> ModelEntry:
    """The registered entry for a Hugging Face config; ValueError naming the supported types otherwise."""
    _load_models()
    mtype = cfg.get("model_type")
    entry = _REGISTRY.get(mtype) if isinstance(mtype, str) else None
    if entry is None:
        raise ValueError(f"model: architecture {mtype!r} is not supported (supported: {sorted(_REGISTRY)})")
    return entry
