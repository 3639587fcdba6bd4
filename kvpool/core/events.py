"""KV cache events for cache-aware routers: which block hashes a replica holds, as they change.

`BlockStored` is emitted when a hash becomes present in a tier and `BlockRemoved` when the last block
holding it is evicted, so a subscriber replaying the stream knows exactly the set of hashes cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | str | None = None
    extra_keys: tuple[tuple[object, ...], ...] = ()
    medium: str = "device"
    group_id: int = 0  # the layer group (hybrid models keep one block per group for the same tokens)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str = "device"
    group_id: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str = field(default="device")


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
