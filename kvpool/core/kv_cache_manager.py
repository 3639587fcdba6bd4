"""The KV cache manager: the scheduler's one entry point to the paged cache.

Its contract follows vLLM V1's manager (see DESIGN.md): `get_computed_blocks` finds the longest cached
prefix without changing any block, `allocate_slots` takes hits and new blocks atomically (or changes
nothing and returns None), `free` releases a request's blocks tail first, and `end_schedule_step`
returns the step's swap plan. One single-type manager per group of layers; one block pool, or, when
the groups' pages differ in size (`page_sizes`), one two-level pool (`kvpool.core.two_level_pool`)
whose `num_blocks` counts large pages.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.block import KVCacheBlock
from kvpool.core.block_pool import BlockPool, DeviceBlockPool
from kvpool.core.events import KVCacheEvent
from kvpool.core.host_pool import HostBlockPool
from kvpool.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from kvpool.core.request import CacheRequest
from kvpool.core.single_type_manager import (
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    make_manager,
)
from kvpool.core.stats import PrefixCacheStats
from kvpool.core.swap import SwapPlan, SwapStats
from kvpool.core.two_level_pool import TwoLevelBlockPool


class KVCacheBlocks:
    """Blocks per group: `blocks[g]` is the list for layer group g.

    From a lookup, `host_blocks` are the hits found in the host tier after the device hits: the
    allocation gives each a device block and schedules the copy.
    """

    __slots__ = ("blocks", "host_blocks")

    def __init__(self, blocks: tuple[list[KVCacheBlock], ...], host_blocks: list[KVCacheBlock] | None = None
                 ) -> None:
        self.blocks = blocks
        self.host_blocks = host_blocks or []

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
        page_sizes: Sequence[int] | None = None,
        block_pool: BlockPool | None = None,
        num_host_blocks: int = 0,
        host_eviction: str = "lru",
        write_through: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.specs = list(specs) if specs else [FullAttentionSpec(block_size=block_size)]
        for s in self.specs:
            if s.block_size != block_size:
                raise ValueError(f"specs: block_size {s.block_size} differs from the manager's {block_size}")
        if page_sizes is not None and len(page_sizes) != len(self.specs):
            raise ValueError(f"page_sizes: {len(page_sizes)} sizes for {len(self.specs)} groups")
        self._two_level: TwoLevelBlockPool | None = None
        if block_pool is None and page_sizes is not None and len(set(page_sizes)) > 1:
            # Pages of different sizes: num_blocks counts large pages (see two_level_pool).
            self._two_level = TwoLevelBlockPool(num_blocks, page_sizes, enable_caching=enable_caching,
                                                enable_kv_events=enable_kv_events)
        self.block_pool = block_pool or self._two_level or DeviceBlockPool(
            num_blocks, enable_caching=enable_caching, enable_kv_events=enable_kv_events)
        self.num_blocks = self.block_pool.num_blocks
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(s, self._two_level.view(g) if self._two_level else self.block_pool, g)
            for g, s in enumerate(self.specs)]
        self.num_groups = len(self.managers)
        self._has_state_groups = any(isinstance(m, MambaManager) for m in self.managers)
        # The hot path serves one full-attention group; other layer types release blocks as they go.
        self._single = self.managers[0] if self.num_groups == 1 and isinstance(self.managers[0],
                                                                               FullAttentionManager) else None
        self.stats = PrefixCacheStats()
        self._interval_stats = PrefixCacheStats()
        self._empty = KVCacheBlocks(tuple([] for _ in self.managers))
        self._swap_plan = SwapPlan()
        self.swap_stats = SwapStats()
        self.host_pool: HostBlockPool | None = None
        self.write_through = write_through
        if num_host_blocks > 0 and enable_caching:
            if self.num_groups > 1:
                raise ValueError("num_host_blocks: the host tier supports one layer group for now")
            if not isinstance(self.managers[0], FullAttentionManager):
                # Its lookup continues a chain of consecutive blocks: full attention's hit rule only.
                raise ValueError("num_host_blocks: the host tier supports full-attention layers only for now")
            self.host_pool = HostBlockPool(num_host_blocks, eviction=host_eviction,
                                           enable_kv_events=enable_kv_events)
            self.block_pool.eviction_listeners.append(self._shelter)
        # Host blocks taking part in this step's copies, unpinned once the plan is handed out; and
        # write-through copies, which can only run once this step's forward has computed them.
        self._pinned_host: list[KVCacheBlock] = []
        self._next_swap_out: list[tuple[int, int]] = []
        self._next_pinned_host: list[KVCacheBlock] = []

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
            host_hit: list[KVCacheBlock] = []
            if self.host_pool is not None:
                # The lookup goes on in the host tier where the device chain stops.
                hashes = request.block_hashes
                get = self.host_pool.cached.get
                for i in range(len(hit), min(max_blocks, len(hashes))):
                    hb = get(hashes[i])
                    if hb is None:
                        break
                    host_hit.append(hb)
                self.stats.host_hits += len(host_hit) * self.block_size
                self._interval_stats.host_hits += len(host_hit) * self.block_size
            num_hit = (len(hit) + len(host_hit)) * self.block_size
            blocks = KVCacheBlocks((hit,), host_hit)
        else:
            hits, request.shared_prefix_blocks = self._hybrid_hit(request.block_hashes, max_blocks)
            num_hit = max(len(h) for h in hits) * self.block_size
            blocks = KVCacheBlocks(hits)
        self.stats.record(num_tokens, num_hit)
        self._interval_stats.record(num_tokens, num_hit)
        return blocks, num_hit

    def _hybrid_hit(self, block_hashes: list[bytes], max_blocks: int
                    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix every group accepts, and the longest any group alone accepts.

        A full-attention hit of n blocks is a hit for any shorter length, but a sliding-window hit is
        not (the window before a shorter point may be gone) and a Mamba hit exists only at a boundary
        whose state is cached. Each group answers with the longest length it accepts up to a limit, so
        shrink the limit to the shortest answer and ask again until all agree: the lengths only
        decrease, and the first length all accept is the largest valid for all (never 0 when some
        length is valid for all). Groups that are never looked up by hash (cross-attention) do not
        take part.
        """
        n = max_blocks
        caching = [m for m in self.managers if m.caches_prefix]
        longest = None
        while True:
            hits = {m.group_id: m.find_longest_cache_hit(block_hashes, n) for m in caching}
            if longest is None:
                longest = max((len(h) for h in hits.values()), default=0)
            shortest = min((len(h) for h in hits.values()), default=0)
            if all(len(h) == shortest for h in hits.values()):
                return tuple(hits.get(m.group_id, []) for m in self.managers), longest
            n = shortest

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
                    before = m.num_cached_block[rid]
                    m.cache_blocks(request, num_tokens if num_tokens < n_hashed else n_hashed)
                    if self.write_through and self.host_pool is not None:
                        self._write_through(table[before:m.num_cached_block[rid]])
                return KVCacheBlocks((new_blocks,))
        managers = self.managers
        if num_lookahead_tokens and self._has_state_groups:
            raise ValueError("num_lookahead_tokens: Mamba layers cannot hold speculative tokens")
        # Blocks that slid out of a window: released only if the allocation goes ahead (a failed one
        # changes nothing), but counted as free space when they are this request's alone.
        skipped = [m.skipped_blocks(rid, request.num_computed_tokens) for m in managers]
        releasable = sum(1 for sk in skipped for b in sk if b.ref_cnt == 1)
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._empty.blocks
        host_hits = new_computed_blocks.host_blocks if new_computed_blocks is not None else []
        # Host hits need device blocks too: they are among the blocks the token count requires.
        need = [m.get_num_blocks_to_allocate(rid, m.num_slots(request, num_slots), hits[g])
                for g, m in enumerate(managers)]
        if self._two_level is not None:
            if not self._two_level.can_allocate(need, skipped, hits):
                return None
        elif sum(need) > self.block_pool.get_num_free_blocks() + releasable:
            return None
        # Every group releases, then every group takes its hits, then every group allocates: a group's
        # new blocks must neither miss the room another group frees nor evict another group's hit.
        for g, m in enumerate(managers):
            m.remove_skipped_blocks(rid, skipped[g])
        for g, m in enumerate(managers):
            m.save_new_computed_blocks(rid, hits[g], request.num_prompt_tokens, request.shared_prefix_blocks)
            if host_hits:
                self._swap_in(rid, m, host_hits)
        new = [m.allocate_new_blocks(rid, m.num_slots(request, num_slots)) for m in managers]
        if self.enable_caching:
            for m in managers:
                before = m.num_cached_block[rid]
                m.cache_blocks(request, num_tokens)  # each type caps it at the hashed blocks
                if self.write_through and self.host_pool is not None:
                    self._write_through(m.req_to_blocks[rid][before:m.num_cached_block[rid]])
        return KVCacheBlocks(tuple(new))

    def free(self, request: CacheRequest | str) -> None:
        """Release a request's blocks, tail first. Safe to call for a request holding none."""
        rid = request if isinstance(request, str) else request.request_id
        for m in self.managers:
            m.free(rid)

    def end_schedule_step(self) -> SwapPlan:
        """The copies the runner must execute before this step's forward pass.

        Swap-outs first (a device block evicted this step may be a swap-in destination of the same
        step), then swap-ins; both before the forward reads the blocks.
        """
        plan = self._swap_plan
        if self.host_pool is not None:
            # No allocation happens between here and the copies: the host blocks may be unpinned now.
            self.host_pool.free_blocks(self._pinned_host)
            self._pinned_host, self._next_pinned_host = self._next_pinned_host, []
        self._swap_plan = SwapPlan(swap_out=self._next_swap_out)
        self._next_swap_out = []
        self.swap_stats.record(plan)
        return plan

    # -- the host tier ---------------------------------------------------------------------------------

    def _shelter(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Device eviction listener: copy the evicted block's content to the host tier."""
        assert self.host_pool is not None
        hb = self.host_pool.shelter(block_hash)
        if hb is not None:
            self._swap_plan.swap_out.append((block.block_id, hb.block_id))
            self._pinned_host.append(hb)

    def _swap_in(self, rid: str, m: SingleTypeKVCacheManager, host_hits: list[KVCacheBlock]) -> None:
        assert self.host_pool is not None
        self.host_pool.touch(host_hits)  # pinned: the copies read them before anything reuses them
        self._pinned_host.extend(host_hits)
        dst = self.block_pool.get_new_blocks(len(host_hits))
        m.req_to_blocks[rid].extend(dst)
        self._swap_plan.swap_in.extend((h.block_id, d.block_id) for h, d in zip(host_hits, dst, strict=True))

    def _write_through(self, blocks: list[KVCacheBlock]) -> None:
        """Eager mode: copy newly cached blocks to the host tier once they are computed (next plan)."""
        assert self.host_pool is not None
        for blk in blocks:
            if blk.block_hash is None:
                continue
            hb = self.host_pool.shelter(blk.block_hash)
            if hb is not None:
                self._next_swap_out.append((blk.block_id, hb.block_id))
                self._next_pinned_host.append(hb)

    # -- state and observability ----------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.managers))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks, in every tier; refused (False) while any request holds blocks."""
        if self.host_pool is not None and (self._pinned_host or self._next_pinned_host):
            return False
        if not self.block_pool.reset_prefix_cache():
            return False
        return self.host_pool.reset_prefix_cache() if self.host_pool is not None else True

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
        events = self.block_pool.take_events()
        return events + self.host_pool.take_events() if self.host_pool is not None else events

    def check_integrity(self) -> None:
        """Assert the block-level invariants, including that each ref count equals its holders."""
        self.block_pool.check_integrity()
        if self.host_pool is not None:
            self.host_pool.check_integrity()
            pins: dict[int, int] = {}
            for b in self._pinned_host + self._next_pinned_host:
                pins[b.block_id] = pins.get(b.block_id, 0) + 1
            for b in self.host_pool.blocks:
                assert b.ref_cnt == pins.get(b.block_id, 0), f"host block {b.block_id}: pins disagree"
        holders: dict[int, int] = {}  # by object: with two-level pages each type has its own block ids
        for m in self.managers:
            for rid, blocks in m.req_to_blocks.items():
                assert m.num_cached_block[rid] <= len(blocks), f"{rid}: more cached blocks than blocks"
                for b in blocks:
                    if not b.is_null:
                        holders[id(b)] = holders.get(id(b), 0) + 1
        for b in self.block_pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == holders.get(id(b), 0), (
                    f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {holders.get(id(b), 0)}")

    def _empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.managers))
