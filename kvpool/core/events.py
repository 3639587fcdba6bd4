"""KV cache events for cache-aware routers: which block hashes a replica holds, as they change.

The shapes follow vLLM's (`vllm.distributed.kv_events`), so consumers written for vLLM's stream
(llm-d's indexer, Dynamo's relay) read kvpool's unchanged: one `BlockStored` per caching call of a
request in a layer group, carrying every block it newly cached in chain order (duplicate copies of a
hash included) with the hash of the block before the first; one `BlockRemoved` per block hash a tier
evicts (a duplicate copy too); `AllBlocksCleared` on a reset. A subscriber counting stored minus
removed per hash knows how many copies each tier holds, and so exactly the set of hashes cached.

`medium` is vLLM's: "GPU" for the device tier (whatever the device: consumers map this name to the
tier that serves hits without a copy) and "CPU" for the host tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"


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
