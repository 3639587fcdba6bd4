"""The store tier behind hybrid models, in the engine: tiny Gemma-3 (five sliding-window groups and a
full-attention group in one host pool) and tiny LFM2 (conv-state groups and an attention group on a
two-level pool: two host page types). A second replica (fresh device and host tiers, the same store: a
file directory or a real redis-server) gets its prefix hits from the store in every group, reading
exactly the blocks the hit point needs, with the same greedy tokens as a run without any cache; a
corrupted value of one group is a miss for the whole prefix (never a hit that group cannot serve); a
store that is down never fails a request."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY_VOCAB, make_tiny_hybrid_gemma3, make_tiny_hybrid_lfm2

from kvpool.core.block import group_key
from kvpool.core.events import BlockStored
from kvpool.core.request import CacheRequest
from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
from kvpool.store import open_store
from kvpool.store.base import Fingerprint, decode_value, encode_value
from kvpool.store.hybrid import FULL, SLIDING, STATE, hit_point
from kvpool.store.server import RedisServer

BS = 4
N_OUT = 8
# Three unrelated 70-token prompts: each can hit 17 blocks (68 tokens; the last token is recomputed).
PROMPTS = [[(7 * i + 3 + k) % TINY_VOCAB for i in range(70)] for k in range(3)]
HIT_BLOCKS = 17
# Per prompt, the blocks a hit at 17 needs: Gemma-3, 17 full-attention blocks and the 6-block window
# (ceil(23 / 4)) of each of the 5 sliding groups; LFM2, 17 attention blocks and the state at 17 of each
# of its 2 conv groups.
NEEDED = {"gemma3": 17 + 5 * 6, "lfm2": 17 + 2}
POOLS = {"gemma3": dict(num_blocks=400, num_host_blocks=600), "lfm2": dict(num_blocks=200, num_host_blocks=300)}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hybrid_gemma3(tmp_path_factory.mktemp("tiny-gemma3-store"))


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hybrid_lfm2(tmp_path_factory.mktemp("tiny-lfm2-store"))


def make(path: Path, model: str, url: str | None, **kw: object) -> LLM:
    args: dict[str, object] = dict(dtype="float32", skip_tokenizer_init=True, block_size=BS, max_num_batched_tokens=32,
                                   write_through=True, kv_store=url, **POOLS[model])
    args.update(kw)
    return LLM(str(path), **args)  # type: ignore[arg-type]


def run(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list:
    return llm.generate(prompts, SamplingParams.greedy(N_OUT), use_tqdm=False)


@pytest.fixture(scope="module")
def expected(gemma3_dir: Path, lfm2_dir: Path) -> dict[str, list[list[int]]]:
    """The store off, and no cache at all."""
    out = {}
    for model, path in (("gemma3", gemma3_dir), ("lfm2", lfm2_dir)):
        ref = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=BS, max_num_batched_tokens=32,
                  enable_prefix_caching=False)
        out[model] = [o.token_ids for o in run(ref)]
    return out


def url_of(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return f"file://{tmp_path}" if backend == "file" else request.getfixturevalue("redis_server").url


def fill(path: Path, model: str, url: str, expected: list[list[int]]) -> None:
    """A first replica computes the prompts and writes every group's blocks through to the store."""
    first = make(path, model, url)
    outs = run(first)
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens == 0 for o in outs)
    st = first.engine.store
    assert st is not None and st.hybrid and st.tier.blocks_written > 0
    st.close()  # flushes the writes; the replica goes away


@pytest.mark.parametrize("backend", ["file", "redis"])
@pytest.mark.parametrize("model", ["gemma3", "lfm2"])
def test_second_replica_hits_the_store_in_every_group(model: str, backend: str, tmp_path: Path,
                                                      request: pytest.FixtureRequest,
                                                      expected: dict[str, list[list[int]]]) -> None:
    path = request.getfixturevalue(f"{model}_dir")
    url = url_of(backend, tmp_path, request)
    fill(path, model, url, expected[model])
    second = make(path, model, url)  # empty device and host tiers, the same store
    st = second.engine.store
    assert st is not None
    kinds = [r.kind for r in st.rules]
    if model == "gemma3":
        assert sorted(kinds) == [FULL] + [SLIDING] * 5 and not second.engine.kv.host.typed
    else:
        assert sorted(kinds) == [FULL, STATE, STATE] and len(second.engine.kv.host.pools) == 2
    # The per-group rule gives the count above.
    assert sum(len(r.needed(HIT_BLOCKS)) for r in st.rules) == NEEDED[model]
    outs = run(second)
    assert [o.token_ids for o in outs] == expected[model]
    assert [o.num_cached_tokens for o in outs] == [HIT_BLOCKS * BS] * 3
    # Exactly the blocks the hit point needs were read (one GET per request) and landed in the host tier;
    # the scheduler's lookup found all of them there as host hits, in every group.
    stats = st.stats.as_dict()
    assert st.tier.blocks_landed == stats["hits"] == stats["lookups"] == 3 * NEEDED[model]
    assert stats["read_calls"] == 3 and stats["corrupt"] == 0
    assert second.engine.scheduler.stats.num_preemptions == 0  # one lookup per request
    assert second.engine.kv.stats.host_hits == 3 * HIT_BLOCKS * BS
    assert second.engine.runner.num_blocks_swapped_in >= 3 * NEEDED[model]
    second.engine.kv.check_integrity()
    # Every host block, landed ones included, carries the layer group its key names (sha256 keys: 32 bytes,
    # plus one naming the group past group 0), so its eviction event names that group.
    host = [b for p in second.engine.kv.host.pools for b in p.blocks if b.block_hash is not None]
    assert host and all(b.block_hash == group_key(b.block_hash[:32], b.group_id) for b in host)
    # Requests sharing a prefix, arriving together: one read of the shared keys, the same tokens.
    shared = [[*PROMPTS[0][:60], *PROMPTS[1][:10]], [*PROMPTS[0][:60], 9, 9, 9]]
    ref = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=BS, max_num_batched_tokens=32,
              enable_prefix_caching=False)
    third = make(path, model, url)
    assert [o.token_ids for o in run(third, shared)] == [o.token_ids for o in run(ref, shared)]
    third.engine.kv.check_integrity()
    assert third.engine.store is not None
    third.engine.store.close()
    st.close()


def corrupt(url: str, fp: Fingerprint, key: bytes, how: str) -> None:
    """One bit flipped (the checksum fails), or a value well framed whose payload is a byte short (a writer
    with a bug: it once failed the copy inside the step and stopped the engine)."""
    store = open_store(url)
    f = store._path(fp.key(key))  # type: ignore[attr-defined]
    data = bytearray(f.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 1
        f.write_bytes(bytes(data))
    else:
        payload = decode_value(fp, key, bytes(data))
        assert payload is not None
        f.write_bytes(encode_value(fp, key, payload[:-1]))


# (the wrong size on LFM2 only: its two page types have two sizes, the case a size check could get wrong)
@pytest.mark.parametrize(("model", "how"), [("gemma3", "flip"), ("lfm2", "flip"), ("lfm2", "size")])
def test_a_corrupt_value_of_one_group_is_a_miss(model: str, how: str, tmp_path: Path,
                                                request: pytest.FixtureRequest,
                                                expected: dict[str, list[list[int]]]) -> None:
    path = request.getfixturevalue(f"{model}_dir")
    url = f"file://{tmp_path}"
    fill(path, model, url, expected[model])
    second = make(path, model, url)
    st = second.engine.store
    assert st is not None
    # One value the hit at 17 needs, of a group that is not full attention: a block inside a sliding
    # window (Gemma-3), the state at 17 (LFM2). Every other group's blocks are fine.
    g = next(g for g, r in enumerate(st.rules) if r.kind != FULL)
    index = 14 if model == "gemma3" else HIT_BLOCKS - 1
    hashes = CacheRequest("x", PROMPTS[0], hasher=second.engine.hasher).block_hashes
    corrupt(url, st.tier.worker.store.fp, group_key(hashes[index], g), how)
    outs = run(second)
    assert [o.token_ids for o in outs] == expected[model]
    # The first prompt's prefix is a miss as a whole: that group cannot serve any point past 0.
    assert [o.num_cached_tokens for o in outs] == [0, HIT_BLOCKS * BS, HIT_BLOCKS * BS]
    stats = st.stats.as_dict()
    assert stats["corrupt"] == 1 and st.tier.blocks_landed == 3 * NEEDED[model] - 1
    # What landed for the first prompt did not make a hit: its own lookup agrees no point works.
    plan = st.read_plan(hashes[:HIT_BLOCKS])
    assert plan.local_point == hit_point(plan.rules, plan.local, HIT_BLOCKS)
    second.engine.kv.check_integrity()
    st.close()
    # Every value corrupt: all misses, the same tokens.
    for f in tmp_path.rglob("kvpool_*"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 1
        f.write_bytes(bytes(data))
    third = make(path, model, url)
    outs = run(third)
    assert [o.token_ids for o in outs] == expected[model]
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert third.engine.store is not None and third.engine.store.stats.corrupt > 0
    assert third.engine.store.tier.blocks_landed == 0
    third.engine.store.close()


@pytest.mark.parametrize("model", ["gemma3", "lfm2"])
def test_a_store_that_is_down_never_fails_a_request(model: str, redis_server: RedisServer,
                                                    request: pytest.FixtureRequest,
                                                    expected: dict[str, list[list[int]]]) -> None:
    path = request.getfixturevalue(f"{model}_dir")
    llm = make(path, model, redis_server.url)
    assert [o.token_ids for o in run(llm, PROMPTS[:1])] == expected[model][:1]
    redis_server.kill()
    # Killed mid-run: reads and writes fail, every request completes with the same tokens.
    assert [o.token_ids for o in run(llm)] == expected[model]
    st = llm.engine.store
    assert st is not None and st.stats.errors >= 1
    llm.engine.kv.check_integrity()
    # A replica started while the store is down serves too.
    other = make(path, model, redis_server.url)
    outs = run(other)
    assert [o.token_ids for o in outs] == expected[model]
    assert all(o.num_cached_tokens == 0 for o in outs)
    redis_server.start()
    assert other.engine.store is not None
    other.engine.store.close()
    st.close()


@pytest.mark.parametrize("model", ["gemma3", "lfm2"])
def test_a_request_waiting_on_anothers_read_still_gets_its_own_hit(model: str, tmp_path: Path,
                                                                    request: pytest.FixtureRequest) -> None:
    """Two prompts sharing a prefix arrive together at a fresh replica: the shorter one waits on keys the
    longer one's read owns, and that read lands only what the longer hit needs (a window or a state further
    on). The shorter one then reads its own: it hit nothing before (48 tokens alone)."""
    path = request.getfixturevalue(f"{model}_dir")
    url = f"file://{tmp_path}"
    base = [(7 * i + 3) % TINY_VOCAB for i in range(80)]
    pair = [base[:72], base[:50]]
    ref = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=BS, max_num_batched_tokens=32,
              enable_prefix_caching=False)
    want = [o.token_ids for o in run(ref, pair)]
    first = make(path, model, url)
    assert [o.token_ids for o in run(first, pair)] == want
    first.engine.store.close()  # type: ignore[union-attr]
    second = make(path, model, url)
    outs = run(second, pair)
    assert [o.token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [HIT_BLOCKS * BS if model == "gemma3" else 64, 48]
    second.engine.kv.check_integrity()
    second.engine.store.close()  # type: ignore[union-attr]


def test_a_landing_whose_copy_fails_is_a_miss_in_every_group(lfm2_dir: Path, tmp_path: Path,
                                                              expected: dict[str, list[list[int]]],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """LFM2 (two page types): a copy into host pages that fails is a miss for what it carried, and the host
    pages sheltered for it are free again and hold no key."""
    from kvpool.store.hybrid import SlotPages

    url = f"file://{tmp_path}"
    fill(lfm2_dir, "lfm2", url, expected["lfm2"])
    second = make(lfm2_dir, "lfm2", url)

    def broken(*_: object) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(SlotPages, "scatter", broken)
    outs = run(second)
    assert [o.token_ids for o in outs] == expected["lfm2"] and all(o.num_cached_tokens == 0 for o in outs)
    st = second.engine.store
    assert st is not None and st.tier.blocks_landed == 0 and st.stats.corrupt > 0
    assert all(not b.ref_cnt for p in second.engine.kv.host.pools for b in p.blocks)  # type: ignore[union-attr]
    second.engine.kv.check_integrity()
    st.close()


@pytest.mark.parametrize("model", ["gemma3", "lfm2"])
def test_every_groups_blocks_the_store_took_are_published(model: str, tmp_path: Path,
                                                          gemma3_dir: Path, lfm2_dir: Path) -> None:
    path = gemma3_dir if model == "gemma3" else lfm2_dir
    llm = make(path, model, f"file://{tmp_path}", enable_kv_events=True)
    run(llm)
    assert llm.engine.store.tier.worker.flush(10)
    got: dict[str, set[tuple[int, bytes]]] = {"CPU": set(), "STORAGE": set()}
    for e in llm.engine.take_kv_events():
        if isinstance(e, BlockStored) and e.medium in got:
            got[e.medium].update((e.group_id, h) for h in e.block_hashes)
    # Each group's blocks under the raw hash a router matches, with their group: the same set the host
    # tier published (write-through), and every one of them readable under its group's key.
    assert got["STORAGE"] == got["CPU"]
    assert {g for g, _ in got["STORAGE"]} == set(range(llm.engine.kv.num_groups))
    store = llm.engine.store.tier.worker.store
    assert all(v is not None for v in store.get([group_key(h, g) for g, h in got["STORAGE"]]))
    llm.engine.store.close()
