"""Per-layer-type managers: the block tables of one group of layers and that type's caching rules.

`FullAttentionManager` keeps every block of a request and accepts any cached prefix of full blocks.
Other layer types (sliding window, Mamba state, cross-attention) subclass `SingleTypeKVCacheManager`
and override the hit rule and which blocks a running request may release early.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.block import BlockHash, KVCacheBlock, group_key
from kvpool.core.block_pool import BlockPool
from kvpool.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvpool.core.request import CacheRequest


class SingleTypeKVCacheManager:
    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already entered in the cache map.
        self.num_cached_block: dict[str, int] = {}

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int
                               ) -> list[KVCacheBlock]:
        raise NotImplementedError

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Free blocks this allocation would consume: new blocks plus hits that sit in the free queue."""
        num_required = -(-num_tokens // self.block_size)
        blocks = self.req_to_blocks.get(request_id)
        have = (len(blocks) if blocks else 0) + len(new_computed_blocks)
        n = num_required - have
        if n < 0:
            n = 0
        for blk in new_computed_blocks:
            if blk.ref_cnt == 0:
                n += 1
        return n

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block[request_id] = 0
        if new_computed_blocks:
            if blocks:
                raise ValueError(f"request {request_id}: prefix hits must come before its first block")
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        n = -(-num_tokens // self.block_size) - len(blocks)
        if n <= 0:
            return []
        new = self.block_pool.get_new_blocks(n)
        blocks.extend(new)
        return new

    def cache_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        """Enter the request's blocks that are full at `num_tokens` in the prefix-cache map."""
        rid = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block[rid]
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full,
                                          self.block_size, self.group_id)
        self.num_cached_block[rid] = num_full

    def skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Blocks no future token will attend to (none, for full attention), newest first. Pure."""
        return []

    def remove_skipped_blocks(self, request_id: str, skipped: list[KVCacheBlock]) -> None:
        """Release the blocks `skipped_blocks` named."""

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            # Tail first: the end of a chain is evicted before its head.
            self.block_pool.free_blocks(reversed(blocks))


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int
                               ) -> list[KVCacheBlock]:
        get = self.block_pool.cached.get
        g = self.group_id
        hit: list[KVCacheBlock] = []
        for i in range(min(max_num_blocks, len(block_hashes))):
            blk = get(block_hashes[i] if g == 0 else group_key(block_hashes[i], g))
            if blk is None:
                break
            hit.append(blk)
        return hit


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Keeps only the blocks the window can still see; the rest of the table is the null block.

    A prefix hit of n blocks needs only the window_blocks blocks right before the hit point to be
    cached: the first token computed after the hit attends to nothing older. Scanning from the
    longest candidate down finds the longest such n (or a fully cached prefix shorter than a window).
    """

    spec: SlidingWindowSpec

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int
                               ) -> list[KVCacheBlock]:
        pool, g = self.block_pool, self.group_id
        null = pool.null_block
        assert null is not None, "sliding-window tables need the null block"
        need = self.spec.window_blocks
        run: list[KVCacheBlock] = []  # cached blocks found so far, last one first
        for i in range(min(max_num_blocks, len(block_hashes)) - 1, -1, -1):
            blk = pool.cached.get(group_key(block_hashes[i], g))
            if blk is None:
                run = []
                continue
            run.append(blk)
            if len(run) == need:
                return [null] * i + run[::-1]
        return run[::-1]  # a cached run reaching back to the first block (shorter than a window)

    def skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(request_id)
        null = self.block_pool.null_block
        if not blocks or null is None:
            return []
        # The next token (at position num_computed_tokens) sees positions >= num_computed_tokens - W + 1.
        first_visible = max(0, num_computed_tokens - self.spec.sliding_window + 1) // self.block_size
        skipped = []
        for i in range(min(first_visible, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break  # everything before was released already
            skipped.append(blocks[i])
        return skipped

    def remove_skipped_blocks(self, request_id: str, skipped: list[KVCacheBlock]) -> None:
        if not skipped:
            return
        blocks = self.req_to_blocks[request_id]
        null = self.block_pool.null_block
        assert null is not None
        end = blocks.index(skipped[0]) + 1  # the newest skipped block ends the run
        for i in range(end - len(skipped), end):
            blocks[i] = null
        # Oldest first, so evicted first: a later hit needs the blocks just before its hit point,
        # and the oldest ones are the least likely to be that.
        self.block_pool.free_blocks(reversed(skipped))


MANAGER_FOR_SPEC: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def make_manager(spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> SingleTypeKVCacheManager:
    cls = MANAGER_FOR_SPEC.get(type(spec))
    if cls is None:
        raise ValueError(f"kv_cache_spec: no manager for {type(spec).__name__}")
    return cls(spec, block_pool, group_id)
