"""What one group of layers needs from the KV cache: tokens per block and bytes per block (page).

Each layer type gets its own spec; a model's layers are grouped by spec (see `kvpool.core.grouping`),
and each group gets one manager and one block table per request. Page sizes are computed from the
layer's shape so that the pool can be sized in bytes and pages of different types can share memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    """Each token attends to the `sliding_window` most recent tokens (itself included).

    `only_group`: this is the model's only KV cache group (`kvpool.core.grouping.group_layers` says so).
    No other group can then cut its prefix hits short, so it never holds a window before a shared prefix's
    end apart from the one before its hit point, and `max_blocks_held` counts one window less. It is
    about the allocator, not the KV bytes: it takes no part in equality, hashing or repr (a store's
    fingerprint). False, the default, is always safe.
    """

    sliding_window: int = 4096
    only_group: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be an int >= 1, got {self.sliding_window!r}")

    def max_blocks_held(self, num_tokens: int, chunk_tokens: int) -> int:
        # What SlidingWindowManager holds for one request at most, with W the window, bs the block size,
        # w = window_blocks and k = chunk_tokens:
        # - the blocks a step reads or fills: after c computed tokens, a chunk of up to k tokens sees
        #   blocks (c - W + 1) // bs to (c + k - 1) // bs, i.e. ceil((r + W - 1 + k) / bs) blocks with
        #   r = (c - W + 1) % bs; at most 1 + ceil((W + k - 2) / bs) (r = bs - 1), which is never more
        #   than w + 1 + ceil(k / bs);
        # - until it is freed, the window before each anchor (SlidingWindowManager.start_request): the
        #   hit point (w blocks), the end of the prefix some group had cached (w more when another group
        #   cut the hit short, so never for the only group), and the prompt's last two boundaries
        #   P // bs and (P - 1) // bs (w + 1 blocks when P is a multiple of bs).
        # Each term is reached, all at once when the anchors are a window apart and the request recomputes
        # past its prompt's end after a preemption (tests/core/test_sliding_bound.py builds that case).
        # Every held block lies in the request's table, hence the cap.
        bs, w = self.block_size, self.window_blocks
        if w == 0:
            # A window of one token: the hit lookup never completes a window of no blocks, so a hit is the
            # whole cached run from block 0, held until the request's next step releases it.
            return -(-num_tokens // bs)
        current = 1 + -(-(self.sliding_window + chunk_tokens - 2) // bs)
        anchors = (2 if self.only_group else 3) * w + 1
        return min(-(-num_tokens // bs), anchors + current)

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
