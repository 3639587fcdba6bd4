"""Pinned prefixes (`kvpool.core.pins`): exact blocks kept under eviction pressure, TTL, budget, salt."""

from __future__ import annotations

import math

import pytest

from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.pins import PinSet, PrefixNotCached
from kvpool.core.request import CacheRequest

BS = 4
SYSTEM = list(range(500, 512))  # 3 full blocks


def pinset(mgr: KVCacheManager, budget: int) -> PinSet:
    pins = PinSet(mgr.block_pool, budget_blocks=budget)
    mgr.external_holders.append(pins.held_blocks)
    return pins


def run(mgr: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> int:
    """Admit, compute and finish a request; its hit tokens."""
    req = CacheRequest(rid, tokens, hasher=BlockHasher(BS), cache_salt=salt)
    hit, n_hit = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit) is not None
    req.num_computed_tokens = req.num_tokens
    mgr.free(req)
    mgr.check_integrity()
    return n_hit


def hashes(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return CacheRequest("h", tokens, hasher=BlockHasher(BS), cache_salt=salt).block_hashes[:len(tokens) // BS]


def pressure(mgr: KVCacheManager, n: int, base: int = 10_000) -> None:
    """One-off requests filling the whole pool n times over."""
    for i in range(n):
        run(mgr, f"p{base + i}", list(range(base + 100 * i, base + 100 * i + 4 * 8)))


@pytest.mark.parametrize("policy", ["lru", "slru", "prefix", "reuse"])
def test_pinned_blocks_survive_pressure_and_go_after_expiry(policy: str) -> None:
    mgr = KVCacheManager(12, BS, eviction_policy=policy)
    run(mgr, "sys", [*SYSTEM, 1])
    pins = pinset(mgr, 3)
    pin = pins.pin(hashes(SYSTEM), now=0.0, ttl=10.0, num_tokens=12)
    assert pin.block_ids == [1, 2, 3]
    assert pins.num_pinned_blocks == 3 and [b.ref_cnt for b in pin.blocks] == [1, 1, 1]
    pressure(mgr, 6)
    assert [mgr.block_pool.get_cached_block(h).block_id for h in hashes(SYSTEM)] == [1, 2, 3]
    assert run(mgr, "q1", [*SYSTEM, 7]) == 12
    # A request wanting every usable block cannot have the pinned ones.
    big = CacheRequest("big", list(range(90_000, 90_044)), hasher=BlockHasher(BS))
    assert mgr.allocate_slots(big, 44) is None
    assert pins.expire(9.9) == []
    assert pins.expire(10.0) == [pin.pin_id]
    assert pins.num_pinned_blocks == 0 and [b.ref_cnt for b in pin.blocks] == [0, 0, 0]
    mgr.check_integrity()
    # Expired: ordinary free blocks, evicted when the pool needs them.
    run(mgr, "big", list(range(90_000, 90_044)))
    assert all(mgr.block_pool.get_cached_block(h) is None for h in hashes(SYSTEM))
    assert run(mgr, "q2", [*SYSTEM, 7]) == 0


def test_without_a_pin_the_same_pressure_evicts_the_prefix() -> None:
    mgr = KVCacheManager(12, BS)
    run(mgr, "sys", [*SYSTEM, 1])
    pressure(mgr, 6)
    assert run(mgr, "q", [*SYSTEM, 7]) == 0


def test_budget_refusal_changes_nothing() -> None:
    mgr = KVCacheManager(12, BS)
    run(mgr, "sys", [*SYSTEM, 1])
    run(mgr, "other", [*range(600, 608), 1])
    pins = pinset(mgr, 4)
    pins.pin(hashes(list(range(600, 608))), now=0.0, ttl=None)
    free_before = mgr.block_pool.free_block_ids()
    with pytest.raises(ValueError, match=r"pin_prefix: 3 more blocks would exceed the pin budget of 4 blocks "
                                         r"\(2 pinned, 2 left\)"):
        pins.pin(hashes(SYSTEM), now=0.0, ttl=5.0)
    assert mgr.block_pool.free_block_ids() == free_before and pins.num_pinned_blocks == 2 and len(pins) == 1
    # A prefix sharing pinned blocks counts only its new ones: the first 2 of SYSTEM's 3 fit.
    pins.pin(hashes(SYSTEM[:8]), now=0.0, ttl=5.0)
    assert pins.num_pinned_blocks == 4


def test_not_cached_and_salted_prefixes_are_not_shared() -> None:
    mgr = KVCacheManager(12, BS)
    run(mgr, "sys", [*SYSTEM, 1], salt="tenant-a")
    pins = pinset(mgr, 6)
    with pytest.raises(PrefixNotCached, match="block 0 of 3 of the prefix is not cached"):
        pins.pin(hashes(SYSTEM), now=0.0, ttl=5.0)  # no salt: other hashes
    with pytest.raises(PrefixNotCached):
        pins.pin(hashes(SYSTEM, "tenant-b"), now=0.0, ttl=5.0)
    pin = pins.pin(hashes(SYSTEM, "tenant-a"), now=0.0, ttl=5.0)
    pressure(mgr, 6)
    assert run(mgr, "b", [*SYSTEM, 7], salt="tenant-b") == 0  # the pin does not serve another salt
    assert run(mgr, "a", [*SYSTEM, 7], salt="tenant-a") == 12
    assert pin.block_ids == [mgr.block_pool.get_cached_block(h).block_id for h in hashes(SYSTEM, "tenant-a")]


def test_each_pin_of_a_prefix_is_its_own_and_unpin_releases_tail_first() -> None:
    mgr = KVCacheManager(12, BS)
    run(mgr, "sys", [*SYSTEM, 1])
    pins = pinset(mgr, 3)
    standing = pins.pin(hashes(SYSTEM), now=0.0, ttl=None)  # e.g. a server's --pin-system-prompt
    pin = pins.pin(hashes(SYSTEM), now=0.0, ttl=5.0)  # a client's pin of the same prompt: no budget of its own
    assert pin.pin_id != standing.pin_id and pin.block_ids == standing.block_ids == [1, 2, 3]
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2] and pins.num_pinned_blocks == 3
    mgr.check_integrity()
    # The client's pin ends (its TTL, or its unpin): the standing one holds the blocks on.
    assert pins.expire(5.0) == [pin.pin_id] and not pins.unpin(pin.pin_id)
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1] and pins.num_pinned_blocks == 3
    pin = standing
    assert pins.unpin(pin.pin_id) and not pins.unpin(pin.pin_id)
    # Released like a finished request: the tail of the chain is evicted before its head.
    order = mgr.block_pool.free_block_ids()
    assert order.index(3) < order.index(2) < order.index(1)
    with pytest.raises(ValueError, match="ttl: must be a number of seconds > 0"):
        pins.pin(hashes(SYSTEM), now=0.0, ttl=0)
    assert not mgr.reset_prefix_cache() or pins.num_pinned_blocks == 0


def test_a_pin_made_again_under_its_id_ends_by_its_own_expiry() -> None:
    mgr = KVCacheManager(12, BS)
    run(mgr, "sys", [*SYSTEM, 1])
    pins = pinset(mgr, 3)
    first = pins.pin(hashes(SYSTEM), now=0.0, ttl=5.0)
    assert [p.pin_id for p in pins.clear()] == [first.pin_id]
    again = pins.pin(hashes(SYSTEM), now=0.0, ttl=10.0, pin_id=first.pin_id)  # (say, after a reset)
    assert pins.expire(6.0) == [] and pins.pins == {first.pin_id: again}  # the old entry ends nothing
    assert pins.expire(10.0) == [first.pin_id] and pins.num_pinned_blocks == 0
    with pytest.raises(ValueError, match="is already pinned"):
        pins.pin(hashes(SYSTEM), now=10.0, ttl=None, pin_id=pins.pin(hashes(SYSTEM), now=10.0, ttl=None).pin_id)


def test_a_pin_made_again_keeps_its_expiry_to_the_bit() -> None:
    """`now + (expires_at - now)` need not round back to `expires_at`: a pin made again (after a failed step)
    is given its expiry as it was, and keeps it exactly."""
    mgr = KVCacheManager(12, BS)
    run(mgr, "sys", [*SYSTEM, 1])
    pins = pinset(mgr, 3)
    end, now = 3814.959660635, 1544.807399587359
    assert now + (end - now) != end  # (the premise)
    first = pins.pin(hashes(SYSTEM), now=0.0, ttl=end)
    pins.clear()
    again = pins.pin(hashes(SYSTEM), now=now, ttl=end - now, pin_id=first.pin_id, expires_at=first.expires_at)
    assert again.expires_at == first.expires_at == end
    assert pins.expire(math.nextafter(end, 0)) == [] and pins.expire(end) == [first.pin_id]
