"""KV cache events for cache-aware routers: which block hashes a replica holds, as they change.

The shapes follow vLLM's (`vllm.distributed.kv_events`), so consumers written for vLLM's stream
(llm-d's indexer, Dynamo's relay) read kvpool's unchanged: one `BlockStored` per caching call of a
request in a layer group, carrying every block it newly cached in chain order (duplicate copies of a
hash included) with the hash of the block before the first; one `BlockRemoved` per block hash a tier
evicts (a duplicate copy too); `AllBlocksCleared` on a reset. A subscriber counting stored minus
removed per hash knows how many copies each tier holds, and so exactly the set of hashes cached.

`medium` is vLLM's: "GPU" for the device tier (whatever the device: consumers map this name to the
tier that serves hits without a copy), "CPU" for the host tier and "STORAGE" for a store below them
(`--kv-store`). A store publishes no removals: it evicts on its own (Redis' maxmemory policy, a file
store's size bound) without telling anyone, so a consumer must bound what it remembers of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.core.block import raw_hash

if TYPE_CHECKING:
    from kvpool.core.block import BlockHash, KVCacheBlock

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_STORE = "STORAGE"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    # The tokens of the blocks' range, in order (block_size per block).
    token_ids: list[int]
    block_size: int
    lora_id: int | str | None = None
    # One entry per stored block: its extra keys (LoRA, multimodal items, salt), or None.
    extra_keys: list[tuple[object, ...] | None] | None = None
    medium: str = MEDIUM_DEVICE
    group_id: int = 0  # the layer group (hybrid models keep one block per group for the same tokens)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str = MEDIUM_DEVICE
    group_id: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str = field(default=MEDIUM_DEVICE)


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def block_stored(blk: KVCacheBlock, key: BlockHash, block_size: int, medium: str) -> BlockStored:
    """The `BlockStored` of one block cached under `key` (its group's key), from the descriptor fields the
    block carries (its tokens, parent, LoRA and extra keys)."""
    return BlockStored(block_hashes=[raw_hash(key, blk.group_id)], parent_block_hash=blk.parent_hash,
                       token_ids=list(blk.token_ids or ()), block_size=block_size, lora_id=blk.lora_id,
                       extra_keys=None if blk.extra_keys is None else [blk.extra_keys], medium=medium,
                       group_id=blk.group_id)
