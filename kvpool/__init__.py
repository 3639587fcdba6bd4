"""kvpool: an LLM inference engine built around its KV cache manager.

The cache core (`kvpool.core`) is pure Python; the engine and runner layers import torch
lazily so that `import kvpool` stays cheap.
"""

__version__ = "0.1.0"
