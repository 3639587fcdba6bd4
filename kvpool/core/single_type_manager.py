"""Per-layer-type managers: the block tables of one group of layers and that type's caching rules.

`FullAttentionManager` keeps every block of a request and accepts any cached prefix of full blocks.
`SlidingWindowManager` releases blocks that left the window; `MambaManager` keeps only the block(s)
holding the request's latest state and caches states at block boundaries; `CrossAttentionManager`
holds blocks for the encoder tokens and takes no part in prefix caching.

Eviction preferences (the RFC's per-type LRU tags): when a sliding-window or Mamba request releases
blocks, those a later hit can use go to the tail of the free queue (evicted last, as usual for cached
blocks); the rest go to the front, cached or not. "Usable" means: within the window before (or, for
Mamba, the state at) a boundary that matters: the request's own hit point (another request reached
it already), the last boundaries of its prompt (a longer prompt starting with it, or the same prompt
again, whose last token is recomputed) and, when the request is freed, its end (a multi-turn
continuation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.core.block import BlockHash, KVCacheBlock, group_key
from kvpool.core.block_pool import AllocationPlan, BlockPool
from kvpool.core.kv_cache_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvpool.core.request import CacheRequest


class SingleTypeKVCacheManager:
    # False for types whose blocks are never looked up by hash (cross-attention): such a group does
    # not limit the length of a hybrid prefix hit.
    caches_prefix = True

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already entered in the cache map.
        self.num_cached_block: dict[str, int] = {}
        # The host tier's map for this group's page type, when there is a host tier: lookups continue
        # there for blocks the device tier no longer holds.
        self.host_cached: dict[BlockHash, KVCacheBlock] | None = None

    def lookup(self, key: BlockHash) -> KVCacheBlock | None:
        """The device block caching `key`, else the host tier's copy, else None."""
        blk = self.block_pool.cached.get(key)
        if blk is None and self.host_cached is not None:
            blk = self.host_cached.get(key)
        return blk

    # -- what the coordinator reads ----------------------------------------------------------------------

    def blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        """A copy of the request's block table in this group (empty if it holds none)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def block_ids_of(self, request_id: str) -> list[int]:
        """The ids of the request's block table in this group (empty if it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def request_ids(self) -> list[str]:
        return list(self.req_to_blocks)

    def num_cached_blocks(self, request_id: str) -> int:
        """Leading blocks of the request entered in the cache map."""
        return self.num_cached_block.get(request_id, 0)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int
                               ) -> list[KVCacheBlock]:
        """The longest hit of at most `max_num_blocks` blocks this type accepts (null where not needed)."""
        raise NotImplementedError

    def num_slots(self, request: CacheRequest, num_slots: int) -> int:
        """Token slots this group needs when the request's sequence needs `num_slots`."""
        return num_slots

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
            # A free device hit leaves the free queue; a host hit needs a device block to land in.
            if blk.ref_cnt == 0 or blk.on_host:
                n += 1
        return n

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                 num_prompt_tokens: int = 0, shared_prefix_blocks: int = 0,
                                 touched: bool = False) -> None:
        """Put the hits at the head of the request's table (taking them, unless `touched` already)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block[request_id] = 0
            self.start_request(request_id, len(new_computed_blocks), num_prompt_tokens, shared_prefix_blocks)
        if new_computed_blocks:
            if blocks:
                raise ValueError(f"request {request_id}: prefix hits must come before its first block")
            if not touched:
                self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)

    def start_request(self, request_id: str, num_hit_blocks: int, num_prompt_tokens: int,
                      shared_prefix_blocks: int = 0) -> None:
        """A request's first allocation in this group (types with eviction preferences note anchors)."""

    def allocate_new_blocks(self, request_id: str, num_tokens: int, plan: AllocationPlan | None = None
                            ) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        n = -(-num_tokens // self.block_size) - len(blocks)
        if n <= 0:
            return []
        new = self.block_pool.get_new_blocks(n, plan)
        blocks.extend(new)
        return new

    def cache_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        """Enter the request's blocks that are full at `num_tokens` in the prefix-cache map."""
        rid = request.request_id
        num_full = num_tokens // self.block_size
        if num_full > len(request.block_hashes):
            num_full = len(request.block_hashes)
        num_cached = self.num_cached_block[rid]
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full,
                                          self.block_size, self.group_id)
        self.num_cached_block[rid] = num_full

    def is_steady(self, request: CacheRequest, num_slots: int, num_tokens: int, caching: bool) -> bool:
        """Whether growing the running request to `num_slots` slots (`num_tokens` of them computed after
        this step), with no new hits, would change nothing here: no block to take, none to release, none
        to cache. Most decode steps are such; the coordinator then skips the group's allocation calls.
        False when unsure (the full allocation path is always correct)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None or -(-self.num_slots(request, num_slots) // self.block_size) > len(blocks):
            return False
        return not caching or num_tokens // self.block_size <= self.num_cached_block[request.request_id]

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

    def pop_release(self, request_id: str
                    ) -> tuple[list[KVCacheBlock], list[tuple[int, KVCacheBlock]], tuple[int, ...]]:
        """Forget the request and say how its blocks should be released, without releasing them (the
        coordinator orders several groups' releases together): blocks no hit will use, blocks worth
        keeping with their table index, and the boundaries (in blocks) where a later hit is likely."""
        blocks = self.req_to_blocks.pop(request_id, None)
        num_full = self.num_cached_block.pop(request_id, 0)
        if not blocks:
            return [], [], ()
        return [], [(i, b) for i, b in enumerate(blocks) if not b.is_null], (num_full,)


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int
                               ) -> list[KVCacheBlock]:
        # The device map's own get when there is no host tier to look in (the hot path: no extra call).
        lookup = self.block_pool.cached.get if self.host_cached is None else self.lookup
        g = self.group_id
        hit: list[KVCacheBlock] = []
        for i in range(min(max_num_blocks, len(block_hashes))):
            blk = lookup(block_hashes[i] if g == 0 else group_key(block_hashes[i], g))
            if blk is None:
                break
            hit.append(blk)
        return hit


class _AnchoredManager(SingleTypeKVCacheManager):
    """Releases blocks early and sorts them by whether a later hit can use them (see module doc)."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        # Per request: boundaries (in blocks) where a later hit is likely.
        self.anchors: dict[str, tuple[int, ...]] = {}

    def start_request(self, request_id: str, num_hit_blocks: int, num_prompt_tokens: int,
                      shared_prefix_blocks: int = 0) -> None:
        # The prompt's end (a later prompt extending it), the last hit point a repeat of the prompt
        # can have (its last token is always recomputed), and where the prefix other requests share
        # ends: some group had it cached, even if this request's hit was cut short by another group.
        bs = self.block_size
        self.anchors[request_id] = (num_hit_blocks, shared_prefix_blocks, num_prompt_tokens // bs,
                                    max(0, num_prompt_tokens - 1) // bs)

    def keeps(self, index: int, boundaries: Sequence[int]) -> bool:
        """Whether block `index` is what a hit at one of `boundaries` needs."""
        raise NotImplementedError

    def keeps_for(self, request_id: str, index: int, boundaries: Sequence[int]) -> bool:
        """`keeps`, for a block of this request (types that retain more per request override it)."""
        return self.keeps(index, boundaries)

    def keeper(self, request_id: str, boundaries: Sequence[int]) -> Callable[[int], bool]:
        """`keeps_for` of the request at these boundaries, as a test of a table index (a release asks it
        of every block, so types whose kept blocks form a small set test membership instead)."""
        return lambda index: self.keeps_for(request_id, index, boundaries)

    def release(self, request_id: str, indexed: list[tuple[int, KVCacheBlock]], at_end: int | None) -> None:
        """Free blocks (given oldest first): usable ones to the tail, the rest to the front."""
        bounds = self.anchors.get(request_id, ())
        if at_end is not None:
            bounds = (*bounds, at_end)
        keep: list[KVCacheBlock] = []
        drop: list[KVCacheBlock] = []
        keeps = self.keeper(request_id, bounds)
        for i, b in indexed:
            (keep if keeps(i) else drop).append(b)
        if drop:
            self.block_pool.free_blocks_to_front(drop)
        if keep:
            # Oldest first among the kept: the newest are the likeliest to be a hit's tail.
            self.block_pool.free_blocks(keep)

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        num_full = self.num_cached_block.pop(request_id, 0)
        if blocks:
            self.release(request_id, [(i, b) for i, b in enumerate(blocks) if not b.is_null], num_full)
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        """Drop the per-request state beyond the table (anchors, and the subclasses' own)."""
        self.anchors.pop(request_id, None)

    def pop_release(self, request_id: str
                    ) -> tuple[list[KVCacheBlock], list[tuple[int, KVCacheBlock]], tuple[int, ...]]:
        blocks = self.req_to_blocks.pop(request_id, None)
        num_full = self.num_cached_block.pop(request_id, 0)
        bounds = (*self.anchors.get(request_id, ()), num_full)
        low: list[KVCacheBlock] = []
        keep: list[tuple[int, KVCacheBlock]] = []
        keeps = self.keeper(request_id, bounds)
        for i, b in enumerate(blocks or ()):
            if not b.is_null:
                if keeps(i):
                    keep.append((i, b))
                else:
                    low.append(b)
        self.forget(request_id)
        return low, keep, bounds if blocks else ()


class SlidingWindowManager(_AnchoredManager):
    """Keeps only the blocks the window can still see (and the windows before its anchors, until it is
    freed); the rest of the table is the null block.

    A prefix hit of n blocks needs only the window_blocks blocks right before the hit point to be
    cached: the first token computed after the hit attends to nothing older. Scanning from the
    longest candidate down finds the longest such n (or a fully cached prefix shorter than a window).
    """

    spec: SlidingWindowSpec

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        self._scanned: dict[str, int] = {}  # per request: table indices below this were dealt with
        self._scan_to: dict[str, int] = {}  # the bound of the last skipped_blocks, applied on removal

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int
                               ) -> list[KVCacheBlock]:
        pool, g = self.block_pool, self.group_id
        null = pool.null_block
        assert null is not None, "sliding-window tables need the null block"
        need = self.spec.window_blocks
        if need == 0:  # a 1-token window reads no earlier KV: any prefix is served by null blocks
            return [null] * min(max_num_blocks, len(block_hashes))
        get = pool.cached.get if self.host_cached is None else self.lookup
        run: list[KVCacheBlock] = []  # cached blocks found so far, last one first
        for i in range(min(max_num_blocks, len(block_hashes)) - 1, -1, -1):
            blk = get(group_key(block_hashes[i], g))
            if blk is None:
                run = []
                continue
            run.append(blk)
            if len(run) == need:
                return [null] * i + run[::-1]
        return run[::-1]  # a cached run reaching back to the first block (shorter than a window)

    def start_request(self, request_id: str, num_hit_blocks: int, num_prompt_tokens: int,
                      shared_prefix_blocks: int = 0) -> None:
        # The window before the hit point stays held even when another group cut the hit short of the
        # shared prefix (num_hit_blocks < shared_prefix_blocks), so that one request holds up to four
        # windows (hit point, shared prefix, prompt's end, the current one). That window is still of use:
        # an earlier request kept it as an anchor of its own (a repeat of its prompt hits there again),
        # and this hit shows it is in use. Released as it slides out, it would go back block by block
        # and be evicted piecemeal while the request runs (one missing block loses every hit at that
        # point). So SlidingWindowSpec.max_blocks_held counts it, rather than this request dropping it.
        if self.spec.only_group:
            # No other group can cut a lone group's hit (the coordinator passes 0): the bound, one
            # window smaller for such a spec, relies on it.
            shared_prefix_blocks = min(shared_prefix_blocks, num_hit_blocks)
        super().start_request(request_id, num_hit_blocks, num_prompt_tokens, shared_prefix_blocks)

    def keeps(self, index: int, boundaries: Sequence[int]) -> bool:
        need = self.spec.window_blocks
        return any(b - need <= index < b for b in boundaries)

    def keeper(self, request_id: str, boundaries: Sequence[int]) -> Callable[[int], bool]:
        need = self.spec.window_blocks
        return {i for b in set(boundaries) for i in range(max(0, b - need), b)}.__contains__

    def _first_visible(self, num_computed_tokens: int, num_blocks: int) -> int:
        # The next token (at position num_computed_tokens) sees positions >= num_computed_tokens - W + 1.
        return min(max(0, num_computed_tokens - self.spec.sliding_window + 1) // self.block_size, num_blocks)

    def is_steady(self, request: CacheRequest, num_slots: int, num_tokens: int, caching: bool) -> bool:
        # ... and no block slid out of the window since the last scan.
        rid = request.request_id
        return (super().is_steady(request, num_slots, num_tokens, caching)
                and self._first_visible(request.num_computed_tokens, len(self.req_to_blocks[rid]))
                <= self._scanned.get(rid, 0))

    def skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Blocks out of the window that no later hit is likely to need, newest first. The window before
        an anchor (see the module doc) is held until the request is freed: releasing it early would let
        it be evicted piecemeal, and one missing block cuts every later hit at that point."""
        blocks = self.req_to_blocks.get(request_id)
        null = self.block_pool.null_block
        if not blocks or null is None:
            return []
        first_visible = self._first_visible(num_computed_tokens, len(blocks))
        self._scan_to[request_id] = first_visible
        bounds = self.anchors.get(request_id, ())
        return [blocks[i] for i in range(first_visible - 1, self._scanned.get(request_id, 0) - 1, -1)
                if blocks[i] is not null and not self.keeps(i, bounds)]

    def remove_skipped_blocks(self, request_id: str, skipped: list[KVCacheBlock]) -> None:
        start = self._scanned.get(request_id, 0)
        end = self._scan_to.pop(request_id, start)
        self._scanned[request_id] = max(start, end)
        if not skipped:
            return
        blocks = self.req_to_blocks[request_id]
        null = self.block_pool.null_block
        assert null is not None
        drop = {id(b) for b in skipped}
        indexed = [(i, blocks[i]) for i in range(start, end) if id(blocks[i]) in drop]
        for i, _ in indexed:
            blocks[i] = null
        self.release(request_id, indexed, None)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._scanned.pop(request_id, None)
        self._scan_to.pop(request_id, None)


class MambaManager(_AnchoredManager):
    """A state per request; block j's page holds the state after the tokens of blocks 0..j.

    Retention: besides the states at its anchors, a request holds the cached states at every
    `retention_interval`-th boundary (the latest `retention_budget` of them) until it is freed, and then
    releases them as hit points of their own; so a later prompt that branches off a long prompt at an
    earlier point still finds a state at most one interval before the branch (the idea of vLLM PR 45845).
    The scheduler ends prefill chunks on those boundaries so that the states exist.

    The runner reads the request's current state from the page of the block holding its last computed
    token and writes the state at the end of the scheduled tokens into the page of the block holding
    the last of them (the same page when it stays in one block). So a running request holds at most
    two real pages (the input and the output state); every other table entry is the null block. A
    page is cached under its block's hash only when the state it received is exactly at that block's
    end (the scheduled tokens ended on the boundary); a prefix hit is the latest block boundary whose
    state is cached: the null block everywhere before it.
    """

    spec: MambaSpec

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        self.held: dict[str, list[int]] = {}  # per request: indices of the real pages, oldest first
        self.retention_interval = 0  # in blocks; 0: keep only the anchors' states
        self.retention_budget = 0

    def keeps_for(self, request_id: str, index: int, boundaries: Sequence[int]) -> bool:
        r = self.retention_interval
        return self.keeps(index, boundaries) or bool(r and (index + 1) % r == 0)

    def _retained(self, request_id: str, held: Sequence[int], current: int) -> set[int]:
        """Held pages before `current` that hold a retained state: the latest `retention_budget` cached
        states at an interval boundary. They stay in the table until the request is freed, so they are
        released with the prefix they make usable (not earlier, to be evicted on their own)."""
        r = self.retention_interval
        if not r or not self.retention_budget:
            return set()
        blocks = self.req_to_blocks[request_id]
        mine = [i for i in held if i < current and (i + 1) % r == 0 and blocks[i].block_hash is not None]
        return set(mine[-self.retention_budget:])

    def pop_release(self, request_id: str
                    ) -> tuple[list[KVCacheBlock], list[tuple[int, KVCacheBlock]], tuple[int, ...]]:
        low, keep, bounds = super().pop_release(request_id)
        r = self.retention_interval
        # A retained state is a hit point of its own: the coordinator releases the prefix up to it as a unit.
        return low, keep, (*bounds, *(i + 1 for i, _ in keep if r and (i + 1) % r == 0))

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int
                               ) -> list[KVCacheBlock]:
        pool, g = self.block_pool, self.group_id
        null = pool.null_block
        assert null is not None, "Mamba tables need the null block"
        get = pool.cached.get if self.host_cached is None else self.lookup
        for i in range(min(max_num_blocks, len(block_hashes)) - 1, -1, -1):
            blk = get(group_key(block_hashes[i], g))
            if blk is not None:
                return [null] * i + [blk]
        return []

    def keeps(self, index: int, boundaries: Sequence[int]) -> bool:
        return index + 1 in boundaries

    def is_steady(self, request: CacheRequest, num_slots: int, num_tokens: int, caching: bool) -> bool:
        # ... and no page it holds is behind the one holding the input state. (A retained state's page
        # stays behind it, so a request retaining states always takes the full path, which sorts them out.)
        held = self.held.get(request.request_id)
        current = (request.num_computed_tokens - 1) // self.block_size
        return super().is_steady(request, num_slots, num_tokens, caching) and all(i >= current for i in held or ())

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        blocks = self.req_to_blocks.get(request_id)
        have = (len(blocks) if blocks else 0) + len(new_computed_blocks)
        n = 1 if -(-num_tokens // self.block_size) > have else 0  # one page for the output state
        if new_computed_blocks and (new_computed_blocks[-1].ref_cnt == 0 or new_computed_blocks[-1].on_host):
            n += 1
        return n

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                 num_prompt_tokens: int = 0, shared_prefix_blocks: int = 0,
                                 touched: bool = False) -> None:
        fresh = request_id not in self.req_to_blocks
        super().save_new_computed_blocks(request_id, new_computed_blocks, num_prompt_tokens, shared_prefix_blocks,
                                         touched)
        if fresh:
            self.held[request_id] = [len(new_computed_blocks) - 1] if new_computed_blocks else []

    def allocate_new_blocks(self, request_id: str, num_tokens: int, plan: AllocationPlan | None = None
                            ) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        n = -(-num_tokens // self.block_size) - len(blocks)
        if n <= 0:
            return []
        null = self.block_pool.null_block
        assert null is not None
        new = [null] * (n - 1) + self.block_pool.get_new_blocks(1, plan)
        blocks.extend(new)
        self.held[request_id].append(len(blocks) - 1)
        return new

    def cache_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        rid = request.request_id
        num_full = num_tokens // self.block_size
        if num_full <= self.num_cached_block[rid]:
            return
        self.num_cached_block[rid] = num_full
        # Only the page receiving the state at exactly a boundary holds a cacheable state.
        if num_tokens % self.block_size == 0 and num_full <= len(request.block_hashes):
            blocks = self.req_to_blocks[rid]
            self.block_pool.cache_full_blocks(request, blocks, num_full - 1, num_full, self.block_size,
                                              self.group_id)

    def skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        held = self.held.get(request_id)
        if not held:
            return []
        current = (num_computed_tokens - 1) // self.block_size  # the page holding the input state
        blocks = self.req_to_blocks[request_id]
        keep = self._retained(request_id, held, current)
        return [blocks[i] for i in reversed(held) if i < current and i not in keep]

    def remove_skipped_blocks(self, request_id: str, skipped: list[KVCacheBlock]) -> None:
        if not skipped:
            return
        blocks = self.req_to_blocks[request_id]
        null = self.block_pool.null_block
        assert null is not None
        held = self.held[request_id]
        gone = [i for i in held if blocks[i] in skipped]
        indexed = [(i, blocks[i]) for i in gone]
        for i in gone:
            blocks[i] = null
        self.held[request_id] = [i for i in held if i not in gone]
        self.release(request_id, indexed, None)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self.held.pop(request_id, None)


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Blocks for the encoder tokens, all taken at the request's first allocation, freed with it.

    Encoder KV is computed from the request's own encoder output; it is never looked up by hash.
    """

    caches_prefix = False

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int
                               ) -> list[KVCacheBlock]:
        return []

    def num_slots(self, request: CacheRequest, num_slots: int) -> int:
        return request.num_encoder_tokens

    def cache_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        """Encoder KV is not prefix-cached."""

    def is_steady(self, request: CacheRequest, num_slots: int, num_tokens: int, caching: bool) -> bool:
        return super().is_steady(request, num_slots, num_tokens, False)  # nothing of it is ever cached

    def free(self, request_id: str) -> None:
        low, _, _ = self.pop_release(request_id)
        if low:
            self.block_pool.free_blocks_to_front(low)

    def pop_release(self, request_id: str
                    ) -> tuple[list[KVCacheBlock], list[tuple[int, KVCacheBlock]], tuple[int, ...]]:
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        return list(blocks or ()), [], ()


MANAGER_FOR_SPEC: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
}


def make_manager(spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> SingleTypeKVCacheManager:
    cls = MANAGER_FOR_SPEC.get(type(spec))
    if cls is None:
        raise ValueError(f"kv_cache_spec: no manager for {type(spec).__name__}")
    return cls(spec, block_pool, group_id)
