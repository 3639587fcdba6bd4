"""`SlidingWindowSpec.max_blocks_held`: the most blocks a sliding-window group holds for one request, which
the engine's max_model_len and pin budget rest on ("a request it accepts fits the pool alone").

A sliding group holds the blocks a step reads or fills and, until the request is freed, the window before
each anchor: its hit point, the end of the prefix another group had cached (when that group cut the hit
short), and its prompt's last two block boundaries. The bound must count all of them, on every path the
manager takes: chunk sizes, cut hybrid hits, preemption and recomputation past the prompt's end.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence

from helpers import make_request
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool.core.block import group_key
from kvpool.core.grouping import group_layers
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvpool.core.request import CacheRequest


def held(mgr: KVCacheManager, request_id: str) -> list[int]:
    """Real (non-null) blocks the request holds, per group."""
    return [sum(1 for b in m.req_to_blocks.get(request_id, ()) if not b.is_null) for m in mgr.managers]


def old_bound(spec: SlidingWindowSpec, num_tokens: int, chunk_tokens: int) -> int:
    """The bound before the fix: one window for the hit point and the shared prefix together, and one
    window (not window + 1 blocks) for the prompt's two last boundaries."""
    bs = spec.block_size
    return min(-(-num_tokens // bs), 3 * spec.window_blocks + 1 + -(-chunk_tokens // bs))


def readmit_after_cut_hit(specs: list[KVCacheSpec], cached: dict[int, int]) -> tuple[int, int]:
    """A request (48-token prompt, 40 outputs) readmitted after a preemption, when the sliding group (0)
    caches only the window before block 2 and the other group (if any) the first 6 blocks: the hit is cut
    to 2 blocks, the shared prefix ends at 6, the prompt at boundaries 12 and 11 (48 is a multiple of 4).
    It recomputes in chunks of up to 8 tokens, the first one 6 (so later steps start 2 past a boundary,
    where the window covers the most blocks). Its peak blocks in the sliding group, and the bound."""
    bs, chunk = 4, 8
    mgr = KVCacheManager(128, bs, specs=specs)
    req = make_request("r", [(5 * i + 1) % 97 for i in range(48)], bs)
    req.append_output_token_ids([(3 * i + 2) % 89 for i in range(40)])
    pool = mgr.block_pool
    for g, n in cached.items():
        for i in range(n):
            blk = pool.blocks[1 + 32 * g + i]
            blk.block_hash = group_key(req.block_hashes[i], g)
            blk.group_id = g
            pool.cached[blk.block_hash] = blk
    hit, n_hit = mgr.get_computed_blocks(req)
    assert n_hit == 2 * bs and req.shared_prefix_blocks == cached.get(1, 0)  # (0 for a lone group)
    assert mgr.allocate_slots(req, 6, n_hit, hit) is not None
    req.num_computed_tokens = n_hit + 6
    peak = held(mgr, "r")[0]
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert mgr.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        peak = max(peak, held(mgr, "r")[0])
    mgr.free(req)
    mgr.check_integrity()
    spec = specs[0]
    assert isinstance(spec, SlidingWindowSpec)
    return peak, spec.max_blocks_held(req.num_tokens, chunk)


def test_a_cut_hybrid_hit_holds_four_windows_and_the_bound_counts_them() -> None:
    # Window 8, blocks of 4: w = 2 blocks. Hit window 2 + shared-prefix window 2 + the prompt's end 3 + the
    # step's 1 + ceil((8 + 8 - 2) / 4) = 5: 12, exactly the bound (the old one said 9).
    sw = SlidingWindowSpec(block_size=4, sliding_window=8)
    peak, bound = readmit_after_cut_hit([sw, FullAttentionSpec(block_size=4)], {0: 2, 1: 6})
    assert peak == bound == 12 > old_bound(sw, 88, 8)


def test_the_only_group_holds_one_window_less() -> None:
    # Alone, nothing cuts the hit: hit window 2 + the prompt's end 3 + the step's 5 = 10, the bound of a
    # spec that knows it is alone (grouping sets it), one window under that of a hybrid model's group.
    alone = SlidingWindowSpec(block_size=4, sliding_window=8, only_group=True)
    peak, bound = readmit_after_cut_hit([alone], {0: 2})
    assert peak == bound == 10 > old_bound(alone, 88, 8)
    assert SlidingWindowSpec(block_size=4, sliding_window=8).max_blocks_held(88, 8) == 12


def test_grouping_marks_a_lone_sliding_group_only() -> None:
    sw = SlidingWindowSpec(block_size=4, sliding_window=8)
    (lone,) = group_layers([sw, sw])
    assert isinstance(lone.spec, SlidingWindowSpec) and lone.spec.only_group
    hybrid = group_layers([sw, FullAttentionSpec(block_size=4)])
    assert not any(getattr(g.spec, "only_group", False) for g in hybrid)
    # An allocator fact, not a KV layout one: equal specs, equal hashes, equal reprs (store fingerprints).
    assert lone.spec == sw and hash(lone.spec) == hash(sw) and repr(lone.spec) == repr(sw)


def test_a_lone_group_never_keeps_a_shared_prefix_window() -> None:
    # Even if handed one (a misuse: a lone group's hit is never cut), it keeps to the window its bound counts.
    alone = SlidingWindowSpec(block_size=4, sliding_window=8, only_group=True)
    mgr = KVCacheManager(64, 4, specs=[alone])
    mgr.managers[0].start_request("r", 2, 48, shared_prefix_blocks=6)
    assert mgr.managers[0].anchors["r"][:2] == (2, 2)


# -- randomized: many requests, shared prefixes, preemption ---------------------------------------------------


LAYOUTS = ["alone", "full+sliding", "two windows"]


def layout_specs(layout: str, bs: int, window: int) -> list[KVCacheSpec]:
    sw = SlidingWindowSpec(block_size=bs, sliding_window=window)
    if layout == "alone":
        return [group.spec for group in group_layers([sw])]
    if layout == "full+sliding":
        return [sw, FullAttentionSpec(block_size=bs)]
    return [sw, SlidingWindowSpec(block_size=bs, sliding_window=2 * window + 1)]


def simulate(specs: Sequence[KVCacheSpec], bs: int, chunk: int, max_len: int, extra: int, seed: int) -> None:
    """Waves of requests sharing prefixes of one base sequence, run by a small scheduler like the engine's
    (a step's token budget split among the running requests at random, preempting the newest when a step
    does not fit), on a pool `extra` blocks over the smallest that admits a `max_len`-token request. Each
    wave finishes before the next comes, so later waves hit what earlier ones left, and a sliding group,
    whose out-of-window blocks are evicted first, often has a shorter hit than a full-attention one.
    Asserts after every allocation that no group holds more than its bound, and that a request running
    alone never fails to allocate (it would preempt itself)."""
    rng = random.Random(seed)
    bounds = [s.max_blocks_held(max_len, chunk) for s in specs]
    mgr = KVCacheManager(1 + sum(bounds) + extra, bs, specs=specs)
    base = [rng.randrange(50) for _ in range(max_len)]
    num = 0

    def check(req: CacheRequest, length: int) -> None:
        for g, (n, s) in enumerate(zip(held(mgr, req.request_id), specs, strict=True)):
            assert n <= s.max_blocks_held(length, chunk), (g, n, s, length, chunk)

    for _ in range(rng.randint(4, 12)):
        waiting: deque[tuple[CacheRequest, int]] = deque()
        for _ in range(rng.randint(1, 3)):
            # A prefix of the base, its own tail, and outputs up to at most max_len tokens.
            shared = rng.randint(0, max_len - 2)
            prompt = base[:shared] + [rng.randrange(50) for _ in range(rng.randint(1, (max_len - shared) // 2))]
            length = rng.randint(len(prompt) + 1, max_len)
            waiting.append((make_request(f"r{num}", prompt, bs), length))
            num += 1
        run_wave(mgr, waiting, chunk, rng, check)
        mgr.check_integrity()


def run_wave(mgr: KVCacheManager, waiting: deque[tuple[CacheRequest, int]], chunk: int, rng: random.Random,
             check: Callable[[CacheRequest, int], None]) -> None:
    """Run requests (each with its final length) to the end, `chunk` tokens a step at most."""
    running: list[tuple[CacheRequest, int]] = []
    while waiting or running:
        budget = chunk
        scheduled: list[tuple[CacheRequest, int, int]] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req, length = running[i]
            n = rng.randint(1, min(req.num_tokens - req.num_computed_tokens, budget))
            while mgr.allocate_slots(req, n) is None:
                assert len(running) > 1, f"{req.request_id} preempts itself while running alone"
                victim, v_len = running.pop()
                mgr.free(victim, preempted=True)
                victim.num_computed_tokens = 0
                waiting.appendleft((victim, v_len))
                preempted = True
                if victim is req:
                    break
            else:
                check(req, length)
                scheduled.append((req, length, n))
                budget -= n
                i += 1
                continue
            break
        while waiting and budget > 0 and not preempted:
            req, length = waiting[0]
            hit, n_hit = mgr.get_computed_blocks(req)
            n = rng.randint(1, min(req.num_tokens - n_hit, budget))
            if mgr.allocate_slots(req, n, n_hit, hit) is None:
                assert running, f"{req.request_id} does not fit the pool alone"
                break
            waiting.popleft()
            req.num_computed_tokens = n_hit
            running.append((req, length))
            check(req, length)
            scheduled.append((req, length, n))
            budget -= n
        for req, length, n in scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                # A token is sampled; the request ends when it reaches its length (the last token is
                # never computed).
                req.append_output_token_ids(rng.randrange(50))
                if req.num_tokens >= length:
                    running.remove((req, length))
                    mgr.free(req)


@settings(max_examples=150, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), bs=st.integers(1, 6), window=st.integers(1, 24), chunk=st.integers(1, 12),
       max_len=st.integers(2, 160), extra=st.integers(0, 200), seed=st.integers(0, 2**16))
@example(layout="full+sliding", bs=4, window=24, chunk=4, max_len=120, extra=0, seed=0)
@example(layout="alone", bs=4, window=24, chunk=8, max_len=120, extra=0, seed=1)
def test_no_request_holds_more_than_the_bound(layout: str, bs: int, window: int, chunk: int, max_len: int,
                                              extra: int, seed: int) -> None:
    simulate(layout_specs(layout, bs, window), bs, chunk, max_len, extra, seed)
