"""The router's match for a hybrid replica is the hit the replica itself computes (kvpool.core.hit_rules).

A replica's KV events (every group's blocks, device and host tiers) go through vLLM's wire encoding into a
`PrefixIndex`; for prompts sharing prefixes of every length, the index's match under the replica's hit rules
must equal `KVCacheManager.get_computed_blocks`, block for block, whatever evicted what.
"""

from __future__ import annotations

import random

import pytest
from helpers import make_request
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core import hit_rules
from kvpool.core.hit_rules import GroupRule, longest_servable
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvpool.router.index import PrefixIndex
from kvpool.server.kv_events import encode_event

BS = 4
FULL = FullAttentionSpec(block_size=BS)
SW = SlidingWindowSpec(block_size=BS, sliding_window=9)  # a hit needs the 2 blocks before it
STATE = MambaSpec(block_size=BS, state_shapes=((2, 3),), state_dtype_bytes=(2,))
TINY = 256
BASES = [[random.Random(k).randrange(1000) for _ in range(64)] for k in range(3)]


def run(mgr: KVCacheManager, rid: str, tokens: list[int], n_out: int) -> None:
    req = make_request(rid, tokens, BS)
    hit, n_hit = mgr.get_computed_blocks(req)
    if mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit) is None:
        return  # (does not fit this small pool: nothing changes)
    req.num_computed_tokens = req.num_tokens
    for t in range(n_out):
        req.append_output_token_ids(7000 + t)
        if mgr.allocate_slots(req, 1) is None:
            break
        req.num_computed_tokens += 1
    mgr.free(req)
    mgr.end_schedule_step()
    mgr.check_integrity()


def routed_hit(index: PrefixIndex, mgr: KVCacheManager, tokens: list[int], rules: bool = True) -> int:
    req = make_request("probe", tokens, BS)
    hashes = req.block_hashes[:(len(tokens) - 1) // BS]  # (the last token is always recomputed)
    return index.match(hashes, ["r"], {"r": mgr.hit_rules} if rules else None)["r"][0] * BS


@settings(max_examples=40, deadline=None)
@given(specs=st.sampled_from([(FULL, SW), (FULL, SW, STATE), (SW, SW), (FULL, STATE)]),
       host=st.sampled_from([0, 24]),
       ops=st.lists(st.tuples(st.integers(0, 2), st.integers(2, 64), st.integers(0, 9)), min_size=1, max_size=14))
def test_the_index_matches_what_the_replica_would_hit(specs: tuple, host: int, ops: list) -> None:
    mgr = KVCacheManager(28, BS, specs=list(specs), enable_kv_events=True, num_host_blocks=host)
    index = PrefixIndex()
    for i, (base, n, n_out) in enumerate(ops):
        run(mgr, f"r{i}", BASES[base][:n], n_out)
        index.apply("r", [encode_event(e) for e in mgr.take_events()])
        for b in range(3):
            for length in range(2, 65, 3):
                probe = BASES[b][:length]
                want = mgr.get_computed_blocks(make_request("probe", probe, BS))[1]
                assert routed_hit(index, mgr, probe) == want, (b, length)


def test_a_full_chain_whose_window_is_gone_is_not_credited() -> None:
    """The full-attention chain outlives the window blocks before its end: a hash any group holds would
    credit the whole prefix, the rules only what the window still covers."""
    mgr = KVCacheManager(40, BS, specs=[FULL, SW], enable_kv_events=True)
    index = PrefixIndex()
    run(mgr, "a", BASES[0][:33], 0)
    events = [encode_event(e) for e in mgr.take_events()]
    index.apply("r", events)
    assert routed_hit(index, mgr, BASES[0][:33]) == routed_hit(index, mgr, BASES[0][:33], rules=False) == 32
    # The window group's last two blocks go (as an eviction would report them).
    req = make_request("h", BASES[0][:33], BS)
    index.apply("r", [{"type": "BlockRemoved", "block_hashes": req.block_hashes[6:8], "medium": "GPU",
                       "group_idx": 1}])
    assert routed_hit(index, mgr, BASES[0][:33], rules=False) == 32
    assert routed_hit(index, mgr, BASES[0][:33]) == 24  # blocks 4 and 5 still end a window at 6 blocks


def test_rules_round_trip_and_bad_ones_are_refused() -> None:
    rules = (GroupRule("full"), GroupRule("window", 3), GroupRule("state"), GroupRule("none"))
    assert hit_rules.encode(rules) == "full,window:3,state,none"
    assert hit_rules.parse("full, window:3,state,none") == rules
    for bad, msg in (("full,window", "a window is `window:<blocks>`"), ("window:-1", "a window is"),
                     ("full:2", "only a window takes an argument"), ("mamba", "unknown group kind 'mamba'"),
                     ("none", "no group that caches a prefix"), ("", "unknown group kind ''")):
        with pytest.raises(ValueError, match=f"^kvpool-kv-groups: {msg}"):
            hit_rules.parse(bad)


def test_longest_servable_by_hand() -> None:
    held = {0: set(range(10)), 1: {0, 1, 2, 6, 7}, 2: {4, 7}}
    rules = (GroupRule("full"), GroupRule("window", 2), GroupRule("state"))
    has = lambda g, i: i in held[g]  # noqa: E731
    assert longest_servable(10, has, rules) == 8  # the window's blocks 6, 7 and the state after block 7
    assert longest_servable(10, has, rules[:2]) == 8
    assert longest_servable(7, has, rules) == 0  # states end 5 blocks (window 3, 4 gone) and 8 (past the limit)
    assert longest_servable(3, has, rules[:2]) == 3  # a window reaching back to block 0
    assert longest_servable(10, has, (GroupRule("window", 0),)) == 10


def test_a_hybrid_replica_tells_its_rules_and_the_router_matches_its_hits(tmp_path_factory: pytest.TempPathFactory
                                                                           ) -> None:
    """Real replica (a tiny Gemma-3: five sliding-window layers and a full one), real HTTP and ZeroMQ: its
    /health carries its groups' rules, the router reads them, and what the router credits for a prompt is
    what the replica then serves from its cache."""
    import httpx
    from helpers import make_tiny_hybrid_gemma3
    from replicas import start_front, start_replica, wait_until

    model = make_tiny_hybrid_gemma3(tmp_path_factory.mktemp("gemma3"))
    h, spec = start_replica(model, skip_tokenizer_init=True)
    front = start_front([spec], None)
    try:
        rules = h.engine.engine.kv.hit_rules
        assert {r.kind for r in rules} == {"full", "window"} and GroupRule("window", 2) in rules
        assert httpx.get(f"{h.url}/health").headers["kvpool-kv-groups"] == hit_rules.encode(rules)
        rep = front.router.replicas[spec.url]
        wait_until(lambda: rep.kv_groups == rules)
        ids = [random.Random(3).randrange(TINY) for _ in range(70)]  # 4 full blocks of 16
        body = {"model": "tiny", "prompt": ids, "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{h.url}/v1/completions", json=body, timeout=60).status_code == 200
        hashes = front.router.route_key("/v1/completions", body).hashes
        credited = wait_until(lambda: front.router.index.match(hashes, [spec.url], {spec.url: rules})[spec.url][0])
        again = httpx.post(f"{h.url}/v1/completions", json=body, timeout=60).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == credited * 16 == 64
    finally:
        front.stop()
        h.stop()


def test_events_with_and_without_groups_and_the_store() -> None:
    """A removal that names no group (the field is optional in vLLM's classes) removes one copy, group 0's
    first; the store's copies count in the group they were stored for."""
    hashes = [bytes([i]) for i in range(4)]
    rules = {"r": (GroupRule("full"), GroupRule("state"))}
    index = PrefixIndex()

    def event(kind: str, group: int | None, which: list[bytes], medium: str = "GPU") -> dict:
        e = {"type": kind, "block_hashes": which, "medium": medium}
        return e if group is None else {**e, "group_idx": group}

    index.apply("r", [event("BlockStored", 0, hashes), event("BlockStored", 1, hashes)])
    assert index.match(hashes, ["r"], rules)["r"] == (4, 4.0)
    index.apply("r", [event("BlockRemoved", None, hashes[1:2])])
    # Group 0's copy went: its chain ends at block 1, where the state after block 0 still is.
    assert index.match(hashes, ["r"], rules)["r"] == (1, 1.0) and index.match(hashes, ["r"])["r"] == (4, 4.0)
    index.apply("r", [event("BlockRemoved", None, hashes[1:2])])  # then group 1's
    assert index.match(hashes, ["r"])["r"] == (1, 1.0) and len(index) == 3
    # The store's group-0 copy of block 1 restores the chain; the states after blocks 2 and 3 are the
    # replica's own: a hit of four blocks, block 1 at the store's weight.
    index.apply("r", [event("BlockStored", 0, hashes[1:2], "STORAGE")])
    assert index.match(hashes, ["r"], rules)["r"] == (4, 3.5)
    index.apply("r", [event("BlockRemoved", None, hashes[1:2], "STORAGE")])
    assert index.match(hashes, ["r"], rules)["r"] == (1, 1.0) and index.num_blocks("*store*") == 0
