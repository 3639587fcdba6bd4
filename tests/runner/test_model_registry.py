"""The model registry: a config's model_type picks the model class, its config parser and input processor."""

from __future__ import annotations

import pytest
from torch import nn

from kvpool.runner.models.gemma3 import Gemma3Arch, Gemma3ForCausalLM
from kvpool.runner.models.lfm2 import Lfm2ForCausalLM
from kvpool.runner.models.llama import LlamaArch, LlamaForCausalLM
from kvpool.runner.models.mllama import MllamaForConditionalGeneration
from kvpool.runner.models.registry import register_model, resolve_model_class, supported_model_types


def test_model_types_resolve_to_their_classes() -> None:
    assert supported_model_types() == ["gemma3_text", "lfm2", "llama", "mistral", "mllama", "qwen2"]
    for mtype, cls in [("llama", LlamaForCausalLM), ("qwen2", LlamaForCausalLM), ("mistral", LlamaForCausalLM),
                       ("gemma3_text", Gemma3ForCausalLM), ("lfm2", Lfm2ForCausalLM),
                       ("mllama", MllamaForConditionalGeneration)]:
        assert resolve_model_class({"model_type": mtype}).model_cls is cls
    assert resolve_model_class({"model_type": "gemma3_text"}).arch_cls is Gemma3Arch
    # Only the cross-attention model brings its own input processor; the others use placeholder embeddings.
    assert [t for t in supported_model_types() if resolve_model_class({"model_type": t}).inputs] == ["mllama"]


@pytest.mark.parametrize("cfg", [{"model_type": "bert"}, {}])
def test_unknown_architecture_is_a_clear_error(cfg: dict) -> None:
    with pytest.raises(ValueError, match=r"model: architecture .* is not supported \(supported: \['gemma3_text'"):
        resolve_model_class(cfg)


def test_a_model_type_registers_once() -> None:
    with pytest.raises(ValueError, match="model_type 'llama' is already registered to LlamaForCausalLM"):
        register_model("llama", arch=LlamaArch)(type("Other", (nn.Module,), {}))
