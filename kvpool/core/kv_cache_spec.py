"""What one group of layers needs from the KV cache: tokens per block and bytes per block (page).

Each layer type gets its own spec; a model's layers are grouped by spec, and each group gets one
manager and one block table per request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: K and V for block_size tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    def max_blocks_held(self, num_tokens: int, chunk_tokens: int) -> int:
        """Most blocks a request of `num_tokens` holds at once, computed in chunks of at most
        `chunk_tokens`: what admission control needs to know that a request fits the pool alone."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token attends to every earlier token: all blocks are kept for the request's lifetime."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Each token attends to the `sliding_window` most recent tokens (itself included)."""

    sliding_window: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1, got {self.sliding_window}")

    def max_blocks_held(self, num_tokens: int, chunk_tokens: int) -> int:
        # The window before a chunk's first token, the chunk itself, and one block of misalignment.
        bound = self.window_blocks + 1 + -(-chunk_tokens // self.block_size)
        return min(-(-num_tokens // self.block_size), bound)

    @property
    def window_blocks(self) -> int:
        """Cached blocks a prefix hit needs right before the hit point: ceil((W - 1) / block_size)."""
        return -(-(self.sliding_window - 1) // self.block_size)
