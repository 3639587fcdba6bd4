"""The KV cache manager: the scheduler's one entry point to the paged cache.

Its contract follows vLLM V1's manager (see DESIGN.md): `get_computed_blocks` finds the longest cached
prefix without changing any block, `allocate_slots` takes hits and new blocks atomically (or changes
nothing and returns None), `free` releases a request's blocks tail first, and `end_schedule_step`
returns the step's swap plan. One single-type manager per group of layers; one block pool, or, when
the groups' pages differ in size (`page_sizes`), one two-level pool (`kvpool.core.two_level_pool`)
whose `num_blocks` counts large pages.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from kvpool.core.block import KVCacheBlock
from kvpool.core.block_pool import AllocationPlan, BlockPool, DeviceBlockPool, TierPool
from kvpool.core.events import KVCacheEvent
from kvpool.core.hit_rules import GroupRule, rule_of
from kvpool.core.host_pool import HostBlockPool
from kvpool.core.host_tier import HostTier, split_host_pages
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

    From a lookup, a list may hold host-tier blocks (`on_host`) where the device tier had no copy: the
    allocation gives each a device block and schedules the copy. `get_block_ids` lists device blocks.
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[list[KVCacheBlock], ...]) -> None:
        self.blocks = blocks

    @property
    def host_blocks(self) -> list[KVCacheBlock]:
        """The host-tier hits of the first group (single-group models: the chain past the device hits)."""
        return [b for b in self.blocks[0] if b.on_host] if self.blocks else []

    def num_host_positions(self) -> int:
        """Positions (blocks of the chain) that some group copies from the host tier."""
        return len({i for group in self.blocks for i, b in enumerate(group) if b.on_host})

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group if not b.on_host] for group in self.blocks)

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
        eviction_policy: str | None = None,
        num_host_blocks: int = 0,
        host_eviction: str = "lru",
        write_through: bool = False,
        state_retention_interval: int = 0,
        state_retention_budget: int = 8,
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
            if eviction_policy not in (None, "lru"):
                # Its order is an LRU over large pages across page types (see two_level_pool).
                raise ValueError(f"eviction_policy: pages of several sizes (a two-level pool) evict LRU only, "
                                 f"got {eviction_policy!r}")
            # Pages of different sizes: num_blocks counts large pages (see two_level_pool).
            self._two_level = TwoLevelBlockPool(num_blocks, page_sizes, enable_caching=enable_caching,
                                                enable_kv_events=enable_kv_events)
        self.block_pool: TierPool = block_pool or self._two_level or DeviceBlockPool(
            num_blocks, enable_caching=enable_caching, enable_kv_events=enable_kv_events,
            eviction_policy=eviction_policy)
        self.num_blocks = self.block_pool.num_blocks
        # Per group, the page type its blocks come from (always 0 unless the pool is two-level).
        self.page_type = list(self._two_level.group_types) if self._two_level else [0] * len(self.specs)
        device_pools: list[BlockPool] = (list(self._two_level.types) if self._two_level
                                         else [self.block_pool])  # type: ignore[list-item]
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(s, device_pools[self.page_type[g]], g) for g, s in enumerate(self.specs)]
        self.num_groups = len(self.managers)
        self._has_state_groups = any(isinstance(m, MambaManager) for m in self.managers)
        if state_retention_interval < 0 or state_retention_budget < 0:
            raise ValueError("state_retention_interval: must be >= 0 blocks (and the budget >= 0)")
        # States kept at every interval-th block boundary of a prompt (the scheduler ends chunks there).
        self.state_retention_interval = state_retention_interval if self._has_state_groups and enable_caching else 0
        for m in self.managers:
            if isinstance(m, MambaManager):
                m.retention_interval = self.state_retention_interval
                m.retention_budget = state_retention_budget
        # The hot path serves one full-attention group; other layer types release blocks as they go.
        self._single = self.managers[0] if self.num_groups == 1 and isinstance(self.managers[0],
                                                                               FullAttentionManager) else None
        self.stats = PrefixCacheStats()
        # Holders of block references besides requests (e.g. `kvpool.core.pins.PinSet.held_blocks`),
        # for the integrity check.
        self.external_holders: list[Callable[[], Iterable[KVCacheBlock]]] = []
        self._interval_stats = PrefixCacheStats()
        self._empty = KVCacheBlocks(tuple([] for _ in self.managers))
        # Each running request's block ids per group, built when asked and dropped whenever its tables may
        # change (any allocation that is not steady, its release): a decode step's tables are mostly the
        # last step's. The lists are never mutated after they are built: callers may keep them.
        self._block_ids: dict[str, tuple[list[int], ...]] = {}
        self.swap_stats = SwapStats()
        self.host: HostTier | None = None
        self.write_through = write_through
        if num_host_blocks > 0 and enable_caching:
            per_type = (split_host_pages(num_host_blocks, [t.per_large for t in self._two_level.types])
                        if self._two_level else [num_host_blocks])
            # Cross-attention blocks are per request and never cached: nothing of theirs is sheltered,
            # because nothing of theirs is ever evicted with a hash.
            self.host = HostTier(device_pools, per_type, typed=self._two_level is not None,
                                 eviction=host_eviction, enable_kv_events=enable_kv_events,
                                 write_through=write_through, block_size=block_size)
            for g, m in enumerate(self.managers):
                m.host_cached = self.host.pools[self.page_type[g]].cached

    @property
    def hit_rules(self) -> tuple[GroupRule, ...]:
        """What a prefix hit needs from each group, for routers (`kvpool.core.hit_rules`)."""
        return tuple(rule_of(m.spec) for m in self.managers)

    @property
    def host_pool(self) -> HostBlockPool | None:
        """The host tier's pool of the first page type (the only one unless the pool is two-level)."""
        return self.host.pools[0] if self.host is not None else None

    @property
    def _swap_plan(self) -> SwapPlan:
        """The plan being built for the next step (tests read it)."""
        return self.host._plan if self.host is not None else SwapPlan()

    # -- scheduling API -------------------------------------------------------------------------------

    def get_computed_blocks(self, request: CacheRequest) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of full blocks, never the whole prompt. Changes nothing: the lookup is
        counted in the prefix cache stats when `allocate_slots` takes its blocks (the request is admitted).

        With a host tier the lookup continues there where the device has no copy; every group must
        accept the hit, wherever its blocks are (a host hit is never a hit one group cannot serve).
        """
        if not self.enable_caching:
            return self._empty_blocks(), 0
        num_tokens = len(request.all_token_ids)
        # The last token is always recomputed: its logits are needed to sample.
        max_blocks = (num_tokens - 1) // self.block_size
        limit = request.max_hit_blocks
        if limit is not None:
            if limit <= 0:
                return self._empty_blocks(), 0
            max_blocks = min(max_blocks, limit)
        if self.num_groups == 1:
            # With a host tier, the lookup goes on there where the device has no copy.
            hit = self.managers[0].find_longest_cache_hit(request.block_hashes, max_blocks)
            return KVCacheBlocks((hit,)), len(hit) * self.block_size
        hits, request.shared_prefix_blocks = self._hybrid_hit(request.block_hashes, max_blocks)
        return KVCacheBlocks(hits), max(len(h) for h in hits) * self.block_size

    def _record_admission(self, request: CacheRequest, hits: KVCacheBlocks, num_hit: int) -> None:
        """The prefix cache stats of a lookup whose request was admitted (its allocation went ahead): a
        request that waits at the head of the queue is looked up again every step, and counting every
        lookup would inflate the hit rate a user reads (vLLM too records at admission). A preempted
        request's admission is counted apart (`PrefixCacheStats.record`)."""
        num_tokens = len(request.all_token_ids)
        self.stats.record(num_tokens, num_hit, request.preempted)
        self._interval_stats.record(num_tokens, num_hit, request.preempted)
        if self.host is not None and not request.preempted:
            num_host = hits.num_host_positions() * self.block_size
            self.stats.host_hits += num_host
            self._interval_stats.host_hits += num_host

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
                    new_blocks = self.block_pool.get_new_blocks(n)  # type: ignore[call-arg]
                    table.extend(new_blocks)
                    self._block_ids.pop(rid, None)
                if self.enable_caching and num_tokens // self.block_size > m.num_cached_block[rid]:
                    n_hashed = len(request.block_hashes) * self.block_size
                    before = m.num_cached_block[rid]
                    m.cache_blocks(request, num_tokens if num_tokens < n_hashed else n_hashed)
                    if self.write_through and self.host is not None:
                        self.host.write_through_blocks(0, table[before:m.num_cached_block[rid]])
                return KVCacheBlocks((new_blocks,))
        managers = self.managers
        if num_lookahead_tokens and self._has_state_groups:
            raise ValueError("num_lookahead_tokens: Mamba layers cannot hold speculative tokens")
        if new_computed_blocks is None and all(m.is_steady(request, num_slots, num_tokens, self.enable_caching)
                                               for m in managers):
            # Several groups, a running request whose tables cover the new tokens with nothing to release
            # or cache (most decode steps): the multi-group hot path.
            return self._empty_blocks()
        self._block_ids.pop(rid, None)
        # Blocks that slid out of a window: released only if the allocation goes ahead (a failed one
        # changes nothing), but counted as free space when they are this request's alone.
        skipped = [m.skipped_blocks(rid, request.num_computed_tokens) for m in managers]
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._empty.blocks
        # Host hits need device blocks too: they are among the blocks the token count requires.
        need = [m.get_num_blocks_to_allocate(rid, m.num_slots(request, num_slots), hits[g])
                for g, m in enumerate(managers)]
        plan = self.block_pool.plan_groups(need, skipped, hits)
        if plan is None:
            return None
        if new_computed_blocks is not None and self.enable_caching:
            self._record_admission(request, new_computed_blocks, num_new_computed_tokens)
        # Every group releases, then every group takes its hits, then every group allocates: a group's
        # new blocks must neither miss the room another group frees nor evict another group's hit.
        for g, m in enumerate(managers):
            m.remove_skipped_blocks(rid, skipped[g])
        if self.host is not None and any(b.on_host for h in hits for b in h):
            self._take_hits_with_swap_ins(request, hits, plan)
        else:
            for g, m in enumerate(managers):
                m.save_new_computed_blocks(rid, hits[g], request.num_prompt_tokens, request.shared_prefix_blocks)
        new = [m.allocate_new_blocks(rid, m.num_slots(request, num_slots), plan) for m in managers]
        if self.enable_caching:
            for g, m in enumerate(managers):
                before = m.num_cached_block[rid]
                m.cache_blocks(request, num_tokens)  # each type caps it at the hashed blocks
                if self.write_through and self.host is not None:
                    table = m.req_to_blocks[rid]
                    self.host.write_through_blocks(self.page_type[g], table[before:m.num_cached_block[rid]])
        return KVCacheBlocks(tuple(new))

    def _take_hits_with_swap_ins(self, request: CacheRequest, hits: tuple[list[KVCacheBlock], ...],
                                 plan: AllocationPlan) -> None:
        """Take hits some of which are host copies: pin every host hit (no eviction this step may reuse
        them), take every device hit (no allocation may evict them), then give each host hit a device
        block, plan the copy and cache the block again under its hash."""
        host = self.host
        assert host is not None
        rid = request.request_id
        for g, h in enumerate(hits):
            on_host = [b for b in h if b.on_host]
            if on_host:
                host.pin(self.page_type[g], on_host)
        for g, m in enumerate(self.managers):
            m.block_pool.touch([b for b in hits[g] if not b.on_host])
        for g, m in enumerate(self.managers):
            table = list(hits[g])
            first = len(table)
            for i, b in enumerate(table):
                if b.on_host:
                    first = min(first, i)
                    (dst,) = m.block_pool.get_new_blocks(1, plan)
                    host.swap_in(self.page_type[g], b, dst)
                    table[i] = dst
            m.save_new_computed_blocks(rid, table, request.num_prompt_tokens, request.shared_prefix_blocks,
                                       touched=True)
            if first < len(table):
                # The copies land before the forward: the device blocks hold the content from now on.
                m.block_pool.cache_full_blocks(request, table, first, len(table), self.block_size, g)

    def free(self, request: CacheRequest | str, preempted: bool = False) -> None:
        """Release a request's blocks, tail first. Safe to call for a request holding none. `preempted`:
        the request will resume (its blocks' next use is its own), not a finished one.

        With several groups, the blocks of all groups are released together, unit by unit: first
        what only the request's last hit point needs (in every group), then what the point before it
        needs, and so on. So eviction takes a whole usable prefix at a time from the end, and never
        empties one group's chain while other groups keep blocks only that chain made useful.
        """
        if isinstance(request, str):
            if preempted:
                # (the mark lives on the request: its next admission is counted apart in the stats)
                raise ValueError("free: preempted=True needs the request itself, not its id")
            rid, n_out = request, None
        else:
            rid = request.request_id
            n_out = None if preempted else request.num_output_tokens
            request.preempted = request.preempted or preempted
        self._block_ids.pop(rid, None)
        # A learning policy may class the blocks by what the finished request generated (a short
        # answer, a tool call, is often continued by the next request; a long one less often). A
        # preempted request's partial output says nothing of that: it goes as "not known".
        self.block_pool.note_release(n_out)
        if self.num_groups == 1:
            self.managers[0].free(rid)
            return
        anchors: set[int] = set()
        releases = []
        for m in self.managers:
            low, keep, points = m.pop_release(rid)
            releases.append((m, low, keep))
            anchors.update(points)
        bounds = sorted(anchors)
        # Rank each kept block by the first hit point that needs it (blocks past every point rank as
        # their own): later points first, tail first within a point, the group order last.
        order: list[tuple[int, int, int, KVCacheBlock]] = []
        for g, (m, low, keep) in enumerate(releases):
            if low:
                m.block_pool.free_blocks_to_front(low)
            for i, b in keep:
                k = bisect_right(bounds, i)
                order.append((-(bounds[k] if k < len(bounds) else i + 1), -i, g, b))
        order.sort(key=lambda e: e[:3])
        pool: BlockPool | None = None
        run: list[KVCacheBlock] = []
        for _, _, g, b in order:
            p = self.managers[g].block_pool
            if p is not pool:
                if pool is not None:
                    pool.free_blocks(run)
                pool, run = p, []
            run.append(b)
        if pool is not None:
            pool.free_blocks(run)

    def end_schedule_step(self) -> SwapPlan:
        """The copies the runner must execute before this step's forward pass.

        Swap-outs first (a device block evicted this step may be a swap-in destination of the same
        step), then swap-ins; both before the forward reads the blocks.
        """
        if self.host is None:
            return SwapPlan()
        plan = self.host.end_step()
        self.swap_stats.record(plan)
        return plan

    # -- state and observability ----------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(m.blocks_of(request_id) for m in self.managers))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, per group (read-only lists: they are kept for the next steps)."""
        ids = self._block_ids.get(request_id)
        if ids is None:
            ids = tuple(m.block_ids_of(request_id) for m in self.managers)
            if any(ids):  # a request that holds blocks (free() drops its entry)
                self._block_ids[request_id] = ids
        return ids

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks, in every tier; refused (False) while any request holds blocks."""
        if self.host is not None and self.host.busy:
            return False
        if not self.block_pool.reset_prefix_cache():
            return False
        return self.host.reset() if self.host is not None else True

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

    @contextmanager
    def stats_paused(self) -> Iterator[None]:
        """Lookups inside are not counted: they are the engine's own (pinned prefixes computed again),
        not traffic, and the hit rate a user reads should be the one their requests saw."""
        saved = self.stats, self._interval_stats
        self.stats, self._interval_stats = PrefixCacheStats(), PrefixCacheStats()
        try:
            yield
        finally:
            self.stats, self._interval_stats = saved

    def take_events(self) -> list[KVCacheEvent]:
        events = self.block_pool.take_events()
        return events + self.host.take_events() if self.host is not None else events

    def check_integrity(self) -> None:
        """Assert the block-level invariants, including that each ref count equals its holders."""
        self.block_pool.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        holders: dict[int, int] = {}  # by object: with two-level pages each type has its own block ids
        for held in self.external_holders:  # references held outside requests (pinned prefixes)
            for b in held():
                holders[id(b)] = holders.get(id(b), 0) + 1
        for m in self.managers:
            for rid in m.request_ids():
                blocks = m.blocks_of(rid)
                assert m.num_cached_blocks(rid) <= len(blocks), f"{rid}: more cached blocks than blocks"
                for b in blocks:
                    assert not b.on_host, f"{rid}: a host block in a block table"
                    if not b.is_null:
                        holders[id(b)] = holders.get(id(b), 0) + 1
        for b in self.block_pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == holders.get(id(b), 0), (
                    f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {holders.get(id(b), 0)}")

    def _empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.managers))
