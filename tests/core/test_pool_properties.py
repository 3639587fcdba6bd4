"""Property-based: random interleavings of the scheduler's calls never break a block invariant.

After every step `check_integrity()` holds (no block both free and in use, ref counts equal their
holders and never negative, every map entry points at a block carrying its hash, the null block never
free); a failed allocation changes nothing; at the end every block is free again.
"""

from __future__ import annotations

from collections import Counter

from helpers import snapshot
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.block import group_key, raw_hash
from kvpool.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.core.eviction import policy_names
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import CrossAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvpool.core.pins import PinBudgetExceeded, PinSet, PrefixNotCached
from kvpool.core.request import CacheRequest
from kvpool.core.single_type_manager import MambaManager

BS = 4
PREFIXES = [list(range(1000, 1012)), list(range(2000, 2006)), [*range(1000, 1008), 5, 5]]


class PoolMachine(RuleBasedStateMachine):
    """Engine-shaped steps: requests are scheduled (admitted, or advanced by a chunk or a decoded
    token) at most once per step, finished only between steps, and `end_step` runs the step's swap
    plan and forward on a content model, so a block labelled with a hash must really hold it."""

    num_encoder_tokens = 0
    # The device tier's eviction policy (and the host tier's where a machine has one): None is LRU.
    eviction_policy: str | None = None

    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_blocks=12, block_size=BS, eviction_policy=self.eviction_policy)

    def __init__(self) -> None:
        super().__init__()
        self.mgr = self.make_manager()
        self.hasher = BlockHasher(BS)
        self.waiting: list[CacheRequest] = []
        self.running: dict[str, CacheRequest] = {}
        self.scheduled: dict[str, tuple[int, int]] = {}  # this step: token range each request computes
        # What each device block holds once the step has run, by (pool, block id): with two-level pages
        # each page size has its own ids.
        self.dev: dict[tuple[int, int], object] = {}
        self.host: dict[int, object] = {}
        self.n = 0

    def idle(self) -> list[str]:
        return sorted(r for r in self.running if r not in self.scheduled)

    @rule(prefix=st.sampled_from(range(len(PREFIXES) + 1)),
          suffix=st.lists(st.integers(0, 9), min_size=0, max_size=14))
    def add_request(self, prefix: int, suffix: list[int]) -> None:
        tokens = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix
        if not tokens:
            tokens = [1]
        self.n += 1
        self.waiting.append(CacheRequest(f"r{self.n}", tokens, hasher=self.hasher,
                                         num_encoder_tokens=self.num_encoder_tokens))

    @precondition(lambda self: self.waiting)
    @rule(chunk=st.integers(1, 20))
    def admit(self, chunk: int) -> None:
        req = self.waiting[0]
        hit, n_hit = self.mgr.get_computed_blocks(req)
        assert n_hit % BS == 0 and n_hit < req.num_tokens
        num_new = min(chunk, req.num_tokens - n_hit)
        before = snapshot(self.mgr)
        out = self.mgr.allocate_slots(req, num_new, n_hit, hit)
        if out is None:
            assert snapshot(self.mgr) == before
            return
        req.num_computed_tokens = n_hit + num_new
        self.waiting.pop(0)
        self.running[req.request_id] = req
        self.scheduled[req.request_id] = (n_hit, n_hit + num_new)

    @precondition(lambda self: self.idle())
    @rule(data=st.data(), token=st.integers(0, 9))
    def step(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(self.idle()))
        req = self.running[rid]
        if req.num_computed_tokens < req.num_tokens:  # still prefilling: next chunk
            num_new = min(data.draw(st.integers(1, 8)), req.num_tokens - req.num_computed_tokens)
        else:  # decoding: append the sampled token first
            req.append_output_token_ids(token)
            num_new = 1
        before = snapshot(self.mgr)
        if self.mgr.allocate_slots(req, num_new) is None:
            assert snapshot(self.mgr) == before
            # Preempt by recompute: free and requeue at the front.
            self.mgr.free(req)
            req.num_computed_tokens = 0
            del self.running[rid]
            self.waiting.insert(0, req)
            return
        self.scheduled[rid] = (req.num_computed_tokens, req.num_computed_tokens + num_new)
        req.num_computed_tokens += num_new

    @precondition(lambda self: self.idle())
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.idle()))
        self.mgr.free(self.running.pop(rid))

    @rule()
    def end_step(self) -> None:
        plan = self.mgr.end_schedule_step()
        outs = [(0, d, h) for d, h in plan.swap_out] + plan.typed_out
        ins = [(0, h, d) for h, d in plan.swap_in] + plan.typed_in
        assert len({(t, h) for t, _, h in outs}) == len(outs)
        assert len({(t, d) for t, _, d in ins}) == len(ins)
        # The runner's order: every swap-out, then every swap-in, then the forward. Copies of page type
        # t move between the t-th device page pool and the t-th host pool.
        dev_pools = self.mgr.host.device_pools if self.mgr.host is not None else []
        for t, d, h in outs:
            self.host[(t, h)] = self.dev.get((id(dev_pools[t]), d))
        for t, h, d in ins:
            self.dev[(id(dev_pools[t]), d)] = self.host.get((t, h))
        for m in self.mgr.managers:
            if not m.caches_prefix:
                continue  # encoder KV: written once, never looked up
            for rid, (start, end) in self.scheduled.items():
                req, table = self.running[rid], m.req_to_blocks[rid]
                if isinstance(m, MambaManager):
                    # Only the page of the last scheduled token receives a state: a block's key only
                    # when the tokens ended exactly on its boundary.
                    last = -(-end // BS) - 1
                    on_boundary = end % BS == 0 and last < len(req.block_hashes)
                    state = (group_key(req.block_hashes[last], m.group_id) if on_boundary
                             else ("state", rid, end, m.group_id))
                    self.dev[(id(m.block_pool), table[last].block_id)] = state
                    continue
                for i in range(start // BS, -(-end // BS)):
                    content = (group_key(req.block_hashes[i], m.group_id) if i < len(req.block_hashes)
                               else ("part", rid, i, m.group_id))
                    self.dev[(id(m.block_pool), table[i].block_id)] = content
        self.scheduled.clear()
        for pool in {id(m.block_pool): m.block_pool for m in self.mgr.managers}.values():
            for b in pool.blocks:
                if b.block_hash is not None:
                    assert self.dev.get((id(pool), b.block_id)) == b.block_hash, (
                        f"device block {b.block_id} holds other content")
        if self.mgr.host is not None:
            nxt = self.mgr._swap_plan  # write-through copies owed by the next step
            owed = {(0, h) for _, h in nxt.swap_out} | {(t, h) for t, _, h in nxt.typed_out}
            for t, hp in enumerate(self.mgr.host.pools):
                for b in hp.blocks:
                    if b.block_hash is not None and (t, b.block_id) not in owed:
                        assert self.host.get((t, b.block_id)) == b.block_hash, (
                            f"host block {b.block_id} of page type {t} holds other content")

    @precondition(lambda self: not self.scheduled)
    @rule()
    def reset(self) -> None:
        pinned = self.mgr.host is not None and self.mgr.host.busy
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.running and not pinned)
        if ok:
            assert not self.mgr.block_pool.cached

    @invariant()
    def integrity(self) -> None:
        self.mgr.check_integrity()

    def teardown(self) -> None:
        for req in self.running.values():
            self.mgr.free(req)
        self.mgr.end_schedule_step()
        self.mgr.end_schedule_step()  # write-through copies owed from the last step
        self.mgr.check_integrity()
        if self.mgr.host is not None:
            assert all(b.ref_cnt == 0 for hp in self.mgr.host.pools for b in hp.blocks), "a host block stayed pinned"
        assert self.mgr.get_num_free_blocks() == self.mgr.block_pool.num_usable_blocks
        assert all(b.ref_cnt == 0 for b in self.mgr.block_pool.blocks if not b.is_null)


class HostTierMachine(PoolMachine):
    """The same interleavings with a small host tier (LRU, write-through) behind the device pool."""

    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_blocks=12, block_size=BS, num_host_blocks=6, write_through=True,
                              eviction_policy=self.eviction_policy,
                              host_eviction=self.eviction_policy or "lru")


class ArcHostTierMachine(PoolMachine):
    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_blocks=12, block_size=BS, num_host_blocks=5, host_eviction="arc")


class HybridMachine(PoolMachine):
    """A full-attention group and a sliding-window group sharing one pool."""

    def make_manager(self) -> KVCacheManager:
        specs = [FullAttentionSpec(block_size=BS), SlidingWindowSpec(block_size=BS, sliding_window=6)]
        return KVCacheManager(num_blocks=24, block_size=BS, specs=specs, eviction_policy=self.eviction_policy)


class MambaHybridMachine(PoolMachine):
    """Full attention, sliding window and Mamba state groups in one pool (Mamba pages hold a state at
    a block boundary; the content model labels the page receiving it with that block's key)."""

    def make_manager(self) -> KVCacheManager:
        specs = [FullAttentionSpec(block_size=BS), SlidingWindowSpec(block_size=BS, sliding_window=6),
                 MambaSpec(block_size=BS, state_shapes=((2, 3),), state_dtype_bytes=(2,))]
        return KVCacheManager(num_blocks=30, block_size=BS, specs=specs, eviction_policy=self.eviction_policy)


class TwoLevelMachine(PoolMachine):
    """The same three groups with pages of different sizes: attention pages of 2 units and Mamba pages
    of 3 share large pages of 6 (3 or 2 small pages each), 7 usable large pages."""

    def make_manager(self) -> KVCacheManager:
        specs = [FullAttentionSpec(block_size=BS), SlidingWindowSpec(block_size=BS, sliding_window=6),
                 MambaSpec(block_size=BS, state_shapes=((2, 3),), state_dtype_bytes=(2,))]
        return KVCacheManager(num_blocks=8, block_size=BS, specs=specs, page_sizes=[2, 2, 3])


HYBRID = [FullAttentionSpec(block_size=BS), SlidingWindowSpec(block_size=BS, sliding_window=6),
          MambaSpec(block_size=BS, state_shapes=((2, 3),), state_dtype_bytes=(2,))]


class HybridHostTierMachine(PoolMachine):
    """A host tier behind full + sliding + state groups in one pool: every group's evicted blocks are
    sheltered under their group's key, and a host hit restores every group or is no hit."""

    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_blocks=24, block_size=BS, specs=HYBRID, num_host_blocks=10)


class TwoLevelHostTierMachine(PoolMachine):
    """The same groups on a two-level pool (pages of 2 and 3 units): one host pool per page size, the
    copies planned per page type; write-through, so copies also come from newly computed blocks."""

    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_blocks=8, block_size=BS, specs=HYBRID, page_sizes=[2, 2, 3],
                              num_host_blocks=4, write_through=True)


class CrossAttentionMachine(PoolMachine):
    """Cross-attention (5 encoder tokens per request), full attention and a window, pages of 3, 2, 2."""

    num_encoder_tokens = 5

    def make_manager(self) -> KVCacheManager:
        specs = [CrossAttentionSpec(block_size=BS), FullAttentionSpec(block_size=BS),
                 SlidingWindowSpec(block_size=BS, sliding_window=6)]
        return KVCacheManager(num_blocks=8, block_size=BS, specs=specs, page_sizes=[3, 2, 2])


class EventsMachine(PoolMachine):
    """KV events replayed by a subscriber: what was stored minus what was removed, per (tier, group,
    hash), is exactly what each tier's blocks hold (the events module's promise to indexers and routers),
    with a host tier behind full + sliding + state groups (keys carrying their group) and write-through."""

    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_blocks=24, block_size=BS, specs=HYBRID, num_host_blocks=10, write_through=True,
                              enable_kv_events=True)

    @invariant()
    def events_tell_what_every_tier_holds(self) -> None:
        if not hasattr(self, "copies"):
            self.copies: Counter[tuple[str, int, bytes]] = Counter()
        for ev in self.mgr.take_events():
            if isinstance(ev, BlockStored | BlockRemoved):
                for h in ev.block_hashes:
                    self.copies[(ev.medium, ev.group_id, h)] += 1 if isinstance(ev, BlockStored) else -1
            elif isinstance(ev, AllBlocksCleared):
                for k in [k for k in self.copies if k[0] == ev.medium]:
                    del self.copies[k]
        pools = {id(m.block_pool): m.block_pool for m in self.mgr.managers}
        tiers = [("GPU", p) for p in pools.values()]
        if self.mgr.host is not None:
            tiers += [("CPU", p) for p in self.mgr.host.pools]
        held = Counter((medium, b.group_id, raw_hash(b.block_hash, b.group_id))
                       for medium, p in tiers for b in p.blocks if b.block_hash is not None)
        assert +self.copies == held and not -self.copies, (
            f"events say {+self.copies - held}, blocks hold {held - +self.copies}")


class StateRetentionMachine(PoolMachine):
    """Mamba states kept at every block boundary of a prompt (within a budget of 2 per request), as the
    engine keeps them every 512 tokens by default, with a host tier."""

    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_blocks=24, block_size=BS, specs=HYBRID, num_host_blocks=10,
                              state_retention_interval=1, state_retention_budget=2)


class PinsMachine(PoolMachine):
    """Pins (kvpool.core.pins) among the requests: overlapping pins of shared prefixes, their own TTLs
    and unpins, refusals that change nothing, and resets that release them (made again from the
    cache when the reset is refused, as the engine does); pinned blocks always carry their hashes."""

    BUDGET = 4

    def __init__(self) -> None:
        super().__init__()
        self.pins = PinSet(self.mgr.block_pool, self.BUDGET, id_prefix="p")
        self.mgr.external_holders.append(self.pins.held_blocks)
        self.now = 0.0
        self.expiry: dict[str, float | None] = {}  # the model: live pin id -> when it ends

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), ttl=st.sampled_from([None, 1.0, 3.0]))
    def pin(self, prefix: int, ttl: float | None) -> None:
        tokens = PREFIXES[prefix]
        hashes = CacheRequest("h", tokens, hasher=self.hasher).block_hashes[:len(tokens) // BS]
        before = (snapshot(self.mgr), self.pins.num_pinned_blocks, sorted(self.pins.pins))
        try:
            pin = self.pins.pin(hashes, now=self.now, ttl=ttl, num_tokens=len(hashes) * BS)
        except PinBudgetExceeded:
            assert self.pins.num_pinned_blocks + len(set(hashes) - self.pinned_hashes()) > self.BUDGET
            assert (snapshot(self.mgr), self.pins.num_pinned_blocks, sorted(self.pins.pins)) == before
            return
        except PrefixNotCached:
            assert any(self.mgr.block_pool.get_cached_block(h) is None for h in hashes)
            assert (snapshot(self.mgr), self.pins.num_pinned_blocks, sorted(self.pins.pins)) == before
            return
        assert pin.pin_id not in self.expiry  # every pin is its own, even of a prefix already pinned
        self.expiry[pin.pin_id] = None if ttl is None else self.now + ttl

    def pinned_hashes(self) -> set:
        return {h for pin in self.pins.pins.values() for h in pin.hashes}

    @precondition(lambda self: self.expiry)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pin_id = data.draw(st.sampled_from(sorted(self.expiry)))
        assert self.pins.unpin(pin_id) and not self.pins.unpin(pin_id)
        del self.expiry[pin_id]

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        gone = self.pins.expire(self.now)
        assert sorted(gone) == sorted(p for p, at in self.expiry.items() if at is not None and at <= self.now)
        for p in gone:
            del self.expiry[p]

    @precondition(lambda self: not self.scheduled)
    @rule()
    def reset(self) -> None:
        saved = self.pins.clear()
        assert sorted(p.pin_id for p in saved) == sorted(self.expiry)
        super().reset()
        if self.mgr.block_pool.cached:  # refused (requests hold blocks): the pins are made again, as they were
            for pin in saved:
                left = None if pin.expires_at is None else pin.expires_at - self.now
                self.pins.pin(pin.hashes, now=self.now, ttl=left, num_tokens=pin.num_tokens, pin_id=pin.pin_id)
        else:
            self.expiry.clear()  # (the engine computes them again; the core alone cannot)

    @invariant()
    def pinned_blocks_hold_their_prefix(self) -> None:
        assert sorted(self.pins.pins) == sorted(self.expiry)
        holders: Counter[int] = Counter()
        for pin in self.pins.pins.values():
            assert [b.block_hash for b in pin.blocks] == list(pin.hashes)
            holders.update(b.block_id for b in pin.blocks)
        for bid, n in holders.items():
            assert self.mgr.block_pool.blocks[bid].ref_cnt >= n
        assert self.pins.num_pinned_blocks == len(holders) <= self.BUDGET

    def teardown(self) -> None:
        self.pins.clear()
        super().teardown()


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestPins = PinsMachine.TestCase
TestPins.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestHostTier = HostTierMachine.TestCase
TestHostTier.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestArcHostTier = ArcHostTierMachine.TestCase
TestHybrid = HybridMachine.TestCase
TestHybrid.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestArcHostTier.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestMambaHybrid = MambaHybridMachine.TestCase
TestMambaHybrid.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestTwoLevel = TwoLevelMachine.TestCase
TestTwoLevel.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestHybridHostTier = HybridHostTierMachine.TestCase
TestHybridHostTier.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestTwoLevelHostTier = TwoLevelHostTierMachine.TestCase
TestTwoLevelHostTier.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestCrossAttention = CrossAttentionMachine.TestCase
TestCrossAttention.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestEvents = EventsMachine.TestCase
TestEvents.settings = settings(max_examples=80, stateful_step_count=60, deadline=None)
TestStateRetention = StateRetentionMachine.TestCase
TestStateRetention.settings = settings(max_examples=80, stateful_step_count=60, deadline=None)


# Every registered policy under the same interleavings (LRU runs above): plain, with a host tier using
# the policy too, and hybrid groups (sliding windows release blocks to the low-value queue). Fewer
# examples each: the machines are the same, only the free-block order differs.
def _policy_case(machine: type[PoolMachine], policy: str) -> type:
    cls = type(f"{machine.__name__}_{policy}", (machine,), {"eviction_policy": policy})
    case = cls.TestCase
    case.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
    return case


for _policy in [p for p in policy_names() if p != "lru"]:
    for _machine in (PoolMachine, HostTierMachine, HybridMachine, MambaHybridMachine):
        globals()[f"Test{_machine.__name__}_{_policy.replace('-', '_')}"] = _policy_case(_machine, _policy)
