"""The KV cache manager: the scheduler's one entry point to the paged cache.

Its contract follows vLLM V1's manager (see DESIGN.md): `get_computed_blocks` finds the longest cached
prefix without changing any block, `allocate_slots` takes hits and new blocks atomically (or changes
nothing and returns None), `free` releases a request's blocks tail first, and `end_schedule_step`
returns the step's swap plan. One single-type manager per group of layers; one block pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.block import KVCacheBlock
from kvpool.core.block_pool import BlockPool, DeviceBlockPool
from kvpool.core.events import KVCacheEvent
from kvpool.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from kvpool.core.request import CacheRequest
from kvpool.core.single_type_manager import SingleTypeKVCacheManager, make_manager
from kvpool.core.stats import PrefixCacheStats
from kvpool.core.swap import SwapPlan


class KVCacheBlocks:
    """Blocks per group: `blocks[g]` is the list for layer group g."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[list[KVCacheBlock], ...]) -> None:
        self.blocks = blocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def __len__(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
        specs: Sequence[KVCacheSpec] | None = None,
        block_pool: BlockPool | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.specs = list(specs) if specs else [FullAttentionSpec(block_size=block_size)]
        for s in self.specs:
            if s.block_size != block_size:
                raise ValueError(f"specs: block_size {s.block_size} differs from the manager's {block_size}")
        self.block_pool = block_pool or DeviceBlockPool(num_blocks, enable_caching=enable_caching,
                                                        enable_kv_events=enable_kv_events)
        self.num_blocks = self.block_pool.num_blocks
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(s, self.block_pool, g) for g, s in enumerate(self.specs)]
        self.num_groups = len(self.managers)
        self._single = self.managers[0] if self.num_groups == 1 else None
        self.stats = PrefixCacheStats()
        self._interval_stats = PrefixCacheStats()
        self._empty = KVCacheBlocks(tuple([] for _ in self.managers))
        self._swap_plan = SwapPlan()

    # -- scheduling API -------------------------------------------------------------------------------

    def get_computed_blocks(self, request: CacheRequest) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of full blocks, never the whole prompt. Changes no block's state."""
        if not self.enable_caching:
            return self._empty_blocks(), 0
        num_tokens = len(request.all_token_ids)
        # The last token is always recomputed: its logits are needed to sample.
        max_blocks = (num_tokens - 1) // self.block_size
        if self.num_groups == 1:
            hit = self.managers[0].find_longest_cache_hit(request.block_hashes, max_blocks)
            num_hit = len(hit) * self.block_size
            blocks = KVCacheBlocks((hit,))
        else:
            hits = [m.find_longest_cache_hit(request.block_hashes, max_blocks) for m in self.managers]
            n = min(len(h) for h in hits)
            num_hit = n * self.block_size
            blocks = KVCacheBlocks(tuple(h[:n] for h in hits))
        self.stats.record(num_tokens, num_hit)
        self._interval_stats.record(num_tokens, num_hit)
        return blocks, num_hit

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens (plus lookahead slots), taking the prefix hits.

        Returns the newly allocated blocks, or None if they do not fit, in which case no ref count,
        free queue or map entry has changed. Blocks that become full are cached at once, so a request
        admitted later in the same step can hit them.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError("allocate_slots: token counts must be >= 0")
        rid = request.request_id
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        num_slots = num_tokens + num_lookahead_tokens
        if new_computed_blocks is None and self._single is not None:
            # A running request growing by a chunk or a decoded token: the hot path of every step.
            m = self._single
            table = m.req_to_blocks.get(rid)
            if table is not None:
                n = -(-num_slots // self.block_size) - len(table)
                new_blocks: list[KVCacheBlock] = []
                if n > 0:
                    if n > self.block_pool.get_num_free_blocks():
                        return None
                    new_blocks = self.block_pool.get_new_blocks(n)
                    table.extend(new_blocks)
                if self.enable_caching and num_tokens // self.block_size > m.num_cached_block[rid]:
                    n_hashed = len(request.block_hashes) * self.block_size
                    m.cache_blocks(request, num_tokens if num_tokens < n_hashed else n_hashed)
                return KVCacheBlocks((new_blocks,))
        managers = self.managers
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._empty.blocks
        need = 0
        for g, m in enumerate(managers):
            need += m.get_num_blocks_to_allocate(rid, num_slots, hits[g])
        if need > self.block_pool.get_num_free_blocks():
            return None
        new: list[list[KVCacheBlock]] = []
        for g, m in enumerate(managers):
            m.save_new_computed_blocks(rid, hits[g])
            new.append(m.allocate_new_blocks(rid, num_slots))
        if self.enable_caching:
            n_hashed = len(request.block_hashes) * self.block_size
            cache_upto = num_tokens if num_tokens < n_hashed else n_hashed
            for m in managers:
                m.cache_blocks(request, cache_upto)
        return KVCacheBlocks(tuple(new))

    def free(self, request: CacheRequest | str) -> None:
        """Release a request's blocks, tail first. Safe to call for a request holding none."""
        rid = request if isinstance(request, str) else request.request_id
        for m in self.managers:
            m.free(rid)

    def end_schedule_step(self) -> SwapPlan:
        """The copies the runner must execute before this step's forward pass."""
        plan, self._swap_plan = self._swap_plan, SwapPlan()
        return plan

    # -- state and observability ----------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.managers))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by running requests (0..1)."""
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the last call (cumulative totals stay in `self.stats`)."""
        s, self._interval_stats = self._interval_stats, PrefixCacheStats()
        return s

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def check_integrity(self) -> None:
        """Assert the block-level invariants, including that each ref count equals its holders."""
        self.block_pool.check_integrity()
        holders: dict[int, int] = {}
        for m in self.managers:
            for rid, blocks in m.req_to_blocks.items():
                assert m.num_cached_block[rid] <= len(blocks), f"{rid}: more cached blocks than blocks"
                for b in blocks:
                    if not b.is_null:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.block_pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == holders.get(b.block_id, 0), (
                    f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {holders.get(b.block_id, 0)}")

    def _empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.managers))
