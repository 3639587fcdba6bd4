"""What one group of layers needs from the KV cache: tokens per block and bytes per block (page).

Each layer type gets its own spec; a model's layers are grouped by spec (see `kvpool.core.grouping`),
and each group gets one manager and one block table per request. Page sizes are computed from the
layer's shape so that the pool can be sized in bytes and pages of different types can share memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1, "int8": 1}


def dtype_bytes(dtype: str | int) -> int:
    """Bytes per element of a dtype name ("bfloat16", ...), or the int itself."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype < 1:
            raise ValueError(f"dtype: bytes per element must be >= 1, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    raise ValueError(f"dtype: unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size", "dtype_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {v!r}")

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
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be an int >= 1, got {self.sliding_window!r}")

    def max_blocks_held(self, num_tokens: int, chunk_tokens: int) -> int:
        # The window before a chunk's first token, the chunk itself, one block of misalignment, and the
        # windows held for later hits (before the shared prefix's end and the prompt's end).
        bound = 3 * self.window_blocks + 1 + -(-chunk_tokens // self.block_size)
        return min(-(-num_tokens // self.block_size), bound)

    @property
    def window_blocks(self) -> int:
        """Cached blocks a prefix hit needs right before the hit point: ceil((W - 1) / block_size)."""
        return -(-(self.sliding_window - 1) // self.block_size)


@dataclass(frozen=True)
class CrossAttentionSpec(KVCacheSpec):
    """Decoder layers attending to the encoder's output (e.g. image tokens in mllama).

    The KV is sized by the request's encoder tokens, not its text: blocks are allocated for
    `CacheRequest.num_encoder_tokens` at the first allocation and kept until the request ends.
    The head config may differ from the self-attention layers'; the page formula is the same.
    `max_encoder_tokens` is the most a request can have (e.g. every tile of one image): what admission
    control counts for this group, whatever the text's length.
    """

    max_encoder_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        v = self.max_encoder_tokens
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"max_encoder_tokens: must be an int >= 0, got {v!r}")

    def max_blocks_held(self, num_tokens: int, chunk_tokens: int) -> int:
        return -(-self.max_encoder_tokens // self.block_size)


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A state-space (Mamba) layer: a fixed per-request state, whatever the sequence length.

    `state_shapes[i]` and `state_dtype_bytes[i]` describe the layer's i-th state tensor (e.g. the
    convolution state and the SSM state); one page holds all of them, so the page size is the state's
    bytes. `block_size` is the caching granularity: the state after each block boundary may be kept
    (in that block's page) so that a later request sharing the prefix resumes from it.
    """

    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtype_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.state_shapes:
            raise ValueError("state_shapes: a Mamba layer needs at least one state tensor")
        if len(self.state_dtype_bytes) != len(self.state_shapes):
            raise ValueError(f"state_dtype_bytes: {len(self.state_dtype_bytes)} entries for "
                             f"{len(self.state_shapes)} state shapes")
        for shape in self.state_shapes:
            if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
                raise ValueError(f"state_shapes: every dimension must be an int >= 1, got {shape!r}")
        for b in self.state_dtype_bytes:
            if not isinstance(b, int) or b < 1:
                raise ValueError(f"state_dtype_bytes: must be ints >= 1, got {b!r}")

    def max_blocks_held(self, num_tokens: int, chunk_tokens: int) -> int:
        # The input and the output state of the running step (see MambaManager).
        return min(-(-num_tokens // self.block_size), 2)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one layer's whole state."""
        return sum(math.prod(s) * b for s, b in zip(self.state_shapes, self.state_dtype_bytes, strict=True))
