"""Property-based: random interleavings of the scheduler's calls never break a block invariant.

After every step `check_integrity()` holds (no block both free and in use, ref counts equal their
holders and never negative, every map entry points at a block carrying its hash, the null block never
free); a failed allocation changes nothing; at the end every block is free again.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.request import CacheRequest

BS = 4
PREFIXES = [list(range(1000, 1012)), list(range(2000, 2006)), [*range(1000, 1008), 5, 5]]


def snapshot(mgr: KVCacheManager) -> tuple:
    pool = mgr.block_pool
    return ([b.ref_cnt for b in pool.blocks], pool.free_block_ids(),
            {h: b.block_id for h, b in pool.cached.items()},
            {rid: [b.block_id for b in bl] for rid, bl in mgr.managers[0].req_to_blocks.items()})


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(num_blocks=12, block_size=BS)
        self.hasher = BlockHasher(BS)
        self.waiting: list[CacheRequest] = []
        self.running: dict[str, CacheRequest] = {}
        self.n = 0

    @rule(prefix=st.sampled_from(range(len(PREFIXES) + 1)),
          suffix=st.lists(st.integers(0, 9), min_size=0, max_size=14))
    def add_request(self, prefix: int, suffix: list[int]) -> None:
        tokens = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix
        if not tokens:
            tokens = [1]
        self.n += 1
        self.waiting.append(CacheRequest(f"r{self.n}", tokens, hasher=self.hasher))

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

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 9))
    def step(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
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
        req.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.mgr.free(self.running.pop(rid))

    @rule()
    def reset(self) -> None:
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            assert not self.mgr.block_pool.cached

    @invariant()
    def integrity(self) -> None:
        self.mgr.check_integrity()

    def teardown(self) -> None:
        for req in self.running.values():
            self.mgr.free(req)
        self.mgr.check_integrity()
        assert self.mgr.get_num_free_blocks() == self.mgr.block_pool.num_usable_blocks
        assert all(b.ref_cnt == 0 for b in self.mgr.block_pool.blocks if not b.is_null)


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
