"""The KV cache block: one page of `block_size` token slots, as the manager tracks it.

A block is also a node of the intrusive free list (`prev_free` / `next_free`), so moving it in or
out of the free queue allocates nothing and costs O(1).
"""

from __future__ import annotations

BlockHash = bytes
"""A block's identity in the prefix cache: H(parent hash, block tokens, extra keys)."""


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "extra_keys", "group_id", "is_null", "lora_id", "next_free", "on_host",
                 "parent_hash", "prev_free", "ref_cnt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Number of running requests whose block table holds this block.
        self.ref_cnt = 0
        # Set once the block is full and cached; cleared when it is evicted.
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False
        # The layer group whose KV the block holds while cached: the map key is per group, since the
        # same tokens need one block per group (see group_key).
        self.group_id = 0
        # A host-tier block (a copy; never in a block table): a hit on it is a swap-in.
        self.on_host = False
        # With KV events on: the cached block's tokens, parent hash, LoRA and extra keys (a tuple, or None
        # without any), so a tier that later receives its content (the host tier, on eviction) can publish
        # a complete BlockStored.
        self.token_ids: list[int] | None = None
        self.parent_hash: BlockHash | None = None
        self.lora_id: int | str | None = None
        self.extra_keys: tuple[object, ...] | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


def group_key(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The prefix-cache key of a block hash in a layer group: the hash itself for group 0."""
    return block_hash if group_id == 0 else block_hash + bytes((group_id,))


def raw_hash(key: BlockHash, group_id: int) -> BlockHash:
    return key if group_id == 0 else key[:-1]
