"""kvpool: an LLM inference engine built around its KV cache manager.

The cache core (`kvpool.core`) is pure Python; the engine and runner layers import torch
lazily so that `import kvpool` stays cheap.
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `from kvpool import LLM, SamplingParams` without importing torch for users of the core alone.
    if name == "LLM":
        from kvpool.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from kvpool.engine import sampling_params

        return getattr(sampling_params, name)
    if name == "LoRARequest":
        from kvpool.engine.lora_request import LoRARequest

        return LoRARequest
    raise AttributeError(name)
