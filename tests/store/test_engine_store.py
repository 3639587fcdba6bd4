"""The store tier in the engine (`kv_store=`), on the tiny Llama: a replica restarted with empty device
and host tiers gets its blocks back from the store (a file directory, or a real redis-server), with the
same tokens as computing them; corrupted values and a store killed mid-run are misses, never failures or
wrong tokens; a request waiting on a slow store computes after its deadline."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvpool.core.events import MEDIUM_STORE, BlockRemoved, BlockStored
from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
from kvpool.server.kv_events import encode_event
from kvpool.store import open_store
from kvpool.store.server import RedisServer

BS = 4
N_NEW = 6


def prompts(seed: int = 0, n: int = 3, length: int = 61) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


def make(model: Path, url: str | None, **kw: object) -> LLM:
    args: dict[str, object] = dict(dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=64,
                                   num_host_blocks=64, write_through=True, kv_store=url)
    args.update(kw)
    return LLM(str(model), **args)  # type: ignore[arg-type]


def run(llm: LLM, ps: list[list[int]]) -> list:
    return llm.generate(ps, SamplingParams.greedy(N_NEW), use_tqdm=False)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> list[list[int]]:
    ref = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=128,
              enable_prefix_caching=False)
    return [o.token_ids for o in run(ref, prompts())]


def restart_round(model: Path, url: str, expected: list[list[int]]) -> tuple[LLM, list]:
    first = make(model, url)
    assert [o.token_ids for o in run(first, prompts())] == expected
    first.engine.store.close()  # flushes the writes; the replica goes away
    second = make(model, url)  # a new process's worth: empty device and host tiers
    outs = run(second, prompts())
    return second, outs


def test_a_burst_needing_more_than_the_host_tier_lands_what_it_holds(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Six prompts of 20 blocks each arrive together at a restarted replica whose store holds them all and
    whose host tier holds 64 blocks: every block was landed, each landing evicting the first ones before
    their requests ran, and no request hit. Now a landing takes what the host tier can hold at once."""
    ps = prompts(seed=5, n=6, length=81)
    ref = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=256,
              enable_prefix_caching=False)
    want = [o.token_ids for o in run(ref, ps)]
    first = make(tiny_llama_dir, f"file://{tmp_path}")
    for p in ps:  # one at a time: each prompt's blocks go through the host tier to the store
        run(first, [p])
    first.engine.store.close()
    second = make(tiny_llama_dir, f"file://{tmp_path}")
    outs = run(second, ps)
    assert [o.token_ids for o in outs] == want
    assert sorted(o.num_cached_tokens for o in outs)[-3:] == [80, 80, 80]  # three prompts' worth of 64 blocks
    assert second.engine.store.tier.blocks_landed <= 64
    second.engine.kv.check_integrity()
    second.engine.store.close()


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_restarted_replica_hits_the_store(tiny_llama_dir: Path, tmp_path: Path, expected: list[list[int]],
                                         backend: str, request: pytest.FixtureRequest) -> None:
    url = f"file://{tmp_path}" if backend == "file" else request.getfixturevalue("redis_server").url
    second, outs = restart_round(tiny_llama_dir, url, expected)
    assert [o.token_ids for o in outs] == expected
    full = (61 - 1) // BS * BS
    assert all(o.num_cached_tokens == full for o in outs), [o.num_cached_tokens for o in outs]
    st = second.engine.store
    assert st.tier.blocks_landed == 3 * (full // BS) and st.stats.round_trips >= 1
    assert second.engine.kv.stats.host_hits == 3 * full  # landed in the host tier, swapped in from there
    second.engine.kv.check_integrity()
    second.engine.store.close()


def test_corrupt_store_is_a_miss(tiny_llama_dir: Path, tmp_path: Path, expected: list[list[int]]) -> None:
    first = make(tiny_llama_dir, f"file://{tmp_path}")
    run(first, prompts())
    first.engine.store.close()
    for f in tmp_path.rglob("kvpool_*"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 1
        f.write_bytes(bytes(data))
    second = make(tiny_llama_dir, f"file://{tmp_path}")
    outs = run(second, prompts())
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens == 0 for o in outs) and second.engine.store.stats.corrupt > 0
    second.engine.store.close()


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_well_framed_value_of_the_wrong_size_is_a_miss(tiny_llama_dir: Path, tmp_path: Path, backend: str,
                                                         expected: list[list[int]],
                                                         request: pytest.FixtureRequest) -> None:
    """A value framed and checksummed under this replica's fingerprint whose payload is not one block (a
    writer with a bug, or anyone writing to the shared store): it once failed the copy inside the step,
    stopped the engine for good and left the host blocks sheltered for it pinned."""
    from kvpool.core.request import CacheRequest
    from kvpool.store.base import decode_value, encode_value

    url = f"file://{tmp_path}" if backend == "file" else request.getfixturevalue("redis_server").url
    first = make(tiny_llama_dir, url)
    run(first, prompts())
    first.engine.store.close()
    second = make(tiny_llama_dir, url)
    st = second.engine.store
    fp, store = st.tier.worker.store.fp, open_store(url)
    hashes = CacheRequest("x", prompts()[0], hasher=second.engine.hasher).block_hashes
    for h in hashes[:3]:
        payload = decode_value(fp, h, store.get_many([fp.key(h)])[0])
        assert payload is not None
        store.put_many([(fp.key(h), encode_value(fp, h, payload[:-1]))])
    outs = run(second, prompts())
    assert [o.token_ids for o in outs] == expected
    # The first prompt misses from its first block on (a chain stops at its first miss); the others hit.
    full = (61 - 1) // BS * BS
    assert [o.num_cached_tokens for o in outs] == [0, full, full]
    assert st.stats.corrupt == 1 and st.tier.blocks_landed == 2 * (full // BS)  # (a chain stops at a miss)
    second.engine.kv.check_integrity()
    st.close()


def test_a_landing_whose_copy_fails_is_a_miss_and_frees_its_host_blocks(
        tiny_llama_dir: Path, tmp_path: Path, expected: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever makes the copy of landed values into host blocks fail (here: it raises), the request is
    served with the same tokens, and the host blocks sheltered for the values are free and hold no key."""
    from kvpool.store import tier

    url = f"file://{tmp_path}"
    first = make(tiny_llama_dir, url)
    run(first, prompts())
    first.engine.store.close()
    second = make(tiny_llama_dir, url)

    def broken(*_: object) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(tier, "scatter", broken)
    host = second.engine.kv.host_pool
    outs = run(second, prompts())
    assert [o.token_ids for o in outs] == expected and all(o.num_cached_tokens == 0 for o in outs)
    st = second.engine.store
    assert st.tier.blocks_landed == 0 and st.stats.corrupt == 3 * ((61 - 1) // BS)
    assert host is not None and not any(b.ref_cnt for b in host.blocks)
    second.engine.kv.check_integrity()
    st.close()


def test_store_killed_mid_run(tiny_llama_dir: Path, redis_server: RedisServer, expected: list[list[int]]) -> None:
    llm = make(tiny_llama_dir, redis_server.url)
    assert [o.token_ids for o in run(llm, prompts()[:1])] == expected[:1]
    redis_server.kill()
    # Reads and writes fail now: every request still completes with the same tokens.
    assert [o.token_ids for o in run(llm, prompts())] == expected
    assert llm.engine.store.stats.errors >= 1
    redis_server.start()
    llm.engine.store.close()


def store_events(llm: LLM) -> tuple[dict[bytes, list[int]], dict[bytes, list[int]]]:
    """Once the store's writes are done: (host, store) `BlockStored` events since the last call, as hash ->
    token ids."""
    assert llm.engine.store.tier.worker.flush(10)
    got: dict[str, dict[bytes, list[int]]] = {"CPU": {}, "STORAGE": {}}
    for e in llm.engine.take_kv_events():
        if isinstance(e, BlockStored) and e.medium in got:
            assert len(e.block_hashes) == 1 and len(e.token_ids) == BS
            got[e.medium][e.block_hashes[0]] = e.token_ids
    return got["CPU"], got["STORAGE"]


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_the_blocks_the_store_took_are_published_as_storage_events(
        tiny_llama_dir: Path, tmp_path: Path, expected: list[list[int]], backend: str,
        request: pytest.FixtureRequest) -> None:
    url = f"file://{tmp_path}" if backend == "file" else request.getfixturevalue("redis_server").url
    llm = make(tiny_llama_dir, url, enable_kv_events=True)
    assert [o.token_ids for o in run(llm, prompts())] == expected
    host, stored = store_events(llm)
    # Write-through: every host copy went on to the store, and each was published once it was there, with
    # the tokens the host tier's event gave it (a router hashes and matches on either).
    assert len(stored) == 3 * ((61 + N_NEW - 1) // BS) and stored == host
    store = llm.engine.store.tier.worker.store
    assert all(v is not None for v in store.get(list(stored)))
    wire = encode_event(BlockStored(block_hashes=[next(iter(stored))], parent_block_hash=None, token_ids=[],
                                    block_size=BS, medium=MEDIUM_STORE))
    assert wire["medium"] == "STORAGE"
    # A replica built without events publishes none of the store's either.
    quiet = make(tiny_llama_dir, f"file://{tmp_path}/quiet")
    run(quiet, prompts(seed=1))
    assert quiet.engine.store.tier.worker.flush(10) and quiet.engine.take_kv_events() == []
    llm.engine.store.close()
    quiet.engine.store.close()


def test_the_events_of_blocks_landed_from_the_store_add_up(tiny_llama_dir: Path, tmp_path: Path,
                                                          expected: list[list[int]]) -> None:
    """A block landed from the store into the host tier is published as no BlockStored (its tokens are not
    known there), so its eviction must publish no BlockRemoved: a subscriber counting stored minus removed
    per hash went negative, and never saw the host tier's real contents."""
    first = make(tiny_llama_dir, f"file://{tmp_path}")
    run(first, prompts())
    first.engine.store.close()
    second = make(tiny_llama_dir, f"file://{tmp_path}", enable_kv_events=True)
    counts: Counter[tuple[str, bytes]] = Counter()

    def drain() -> None:
        assert second.engine.store.tier.worker.flush(10)
        for e in second.engine.take_kv_events():
            if isinstance(e, BlockStored | BlockRemoved):
                for h in e.block_hashes:
                    counts[e.medium, h] += 1 if isinstance(e, BlockStored) else -1
        assert min(counts.values(), default=0) >= 0, "more removed than stored"

    assert [o.token_ids for o in run(second, prompts())] == expected  # landed from the store
    assert second.engine.store.tier.blocks_landed > 0
    drain()
    run(second, prompts(seed=5))  # written through to the host tier: the landed copies are evicted
    drain()
    host = second.engine.kv.host.pools[0]  # type: ignore[union-attr]
    assert {h for (m, h), n in counts.items() if m == "CPU" and n > 0} <= set(host.cached)
    second.engine.kv.check_integrity()
    second.engine.store.close()


def test_a_store_that_is_down_publishes_no_storage_events(tiny_llama_dir: Path, redis_server: RedisServer,
                                                         expected: list[list[int]]) -> None:
    llm = make(tiny_llama_dir, redis_server.url, enable_kv_events=True)
    redis_server.kill()
    assert [o.token_ids for o in run(llm, prompts())] == expected
    host, stored = store_events(llm)
    assert host and stored == {}  # the host tier has the blocks, the store took none: no router is told so
    redis_server.start()
    llm.engine.store.close()


def test_a_fault_in_the_stores_code_costs_the_store_hit_not_the_request(
        tiny_llama_dir: Path, tmp_path: Path, expected: list[list[int]], caplog: pytest.LogCaptureFixture) -> None:
    llm = make(tiny_llama_dir, f"file://{tmp_path}")

    def broken(req: object) -> bool:
        raise RuntimeError("a bug in the store tier")

    llm.engine.store.hold = broken  # type: ignore[method-assign]
    outs = run(llm, prompts())
    assert [o.token_ids for o in outs] == expected and llm.engine.store.num_held() == 0
    assert caplog.text.count("it computes its blocks") == 3
    llm.engine.kv.check_integrity()
    llm.engine.store.close()


def test_refused_without_a_host_tier(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_store"):
        make(tiny_llama_dir, f"file://{tmp_path}", num_host_blocks=0, write_through=False)
    with pytest.raises(ValueError, match="kv_store"):
        make(tiny_llama_dir, "ftp://x")
    assert open_store(f"file://{tmp_path}") is not None


def test_store_metrics_on_the_server(chat_llama_dir: Path, tmp_path: Path) -> None:
    import httpx

    from kvpool.engine.engine import LLMEngine
    from kvpool.server.serve import start_server

    eng = LLMEngine(model=str(chat_llama_dir), dtype="float32", num_blocks=64, block_size=16, max_model_len=256,
                    num_host_blocks=64, write_through=True, kv_store=f"file://{tmp_path}")
    h = start_server(eng, served_model_name="tiny")
    try:
        r = httpx.post(f"{h.url}/v1/completions", json={"prompt": list(range(100, 150)), "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        eng.store.tier.worker.flush(5)
        text = httpx.get(f"{h.url}/metrics").text
        assert 'kvpool:store_available{model_name="tiny"} 1.0' in text
        written = [ln for ln in text.splitlines() if ln.startswith("kvpool:store_bytes_written_total")]
        assert written and float(written[0].split()[-1]) > 0
        # The 50-token prompt step (3 blocks of 16) was timed: what computing a block costs here.
        per_block = [ln for ln in text.splitlines() if ln.startswith("kvpool:store_recompute_seconds_per_block")]
        assert per_block and float(per_block[0].split()[-1]) == eng.store.tier.recompute_s_per_block > 0
        assert 'kvpool:store_requests_not_held_recompute_total{model_name="tiny"} 0.0' in text
    finally:
        h.stop()
        eng.store.close()


def test_frozen_store_costs_a_deadline_not_a_failure(tiny_llama_dir: Path, redis_server: RedisServer,
                                                     expected: list[list[int]]) -> None:
    """A store that stops answering (SIGSTOP: connections hang, nothing is refused): requests wait their
    deadline, then compute with the same tokens; a request still waiting can be aborted."""
    import os
    import signal
    import time

    llm = make(tiny_llama_dir, redis_server.url, kv_store_deadline_s=0.3)
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        eng = llm.engine
        req = eng.add_request(prompts(seed=5)[0], SamplingParams.greedy(2), request_id="0")  # the caller's id
        assert eng.store.is_held(req.request_id)
        assert eng.stats().num_waiting == 1  # (the load a router reads counts a request held for its reads)
        other = eng.add_request(prompts(seed=6)[0], SamplingParams.greedy(2))  # the engine picks an id not in use
        assert other.request_id == "1" and eng.store.is_held("1")
        with pytest.raises(ValueError, match="request_id: '0' is already in use"):
            eng.add_request(prompts(seed=7)[0], SamplingParams.greedy(2), request_id="0")
        assert eng.abort_request("0") and eng.abort_request("1") and not eng.has_unfinished_requests()
        t0 = time.perf_counter()
        assert [o.token_ids for o in run(llm, prompts())] == expected
        assert time.perf_counter() - t0 < 30
        assert eng.store.tier.requests_timed_out >= 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    llm.engine.store.close()


def test_a_store_slower_than_recomputing_holds_no_request(tiny_llama_dir: Path, tmp_path: Path,
                                                           expected: list[list[int]]) -> None:
    """The engine times its prompt steps; once the store's reads are measured slower than computing the
    blocks (LMCache issue 914: a remote Redis slower than recomputing), an arriving request is not held: it
    computes at once, with the same tokens, and its blocks are read behind it for later requests."""
    url = f"file://{tmp_path}"
    first = make(tiny_llama_dir, url)
    run(first, prompts())
    first.engine.store.close()
    second = make(tiny_llama_dir, url)
    eng, tier = second.engine, second.engine.store.tier
    assert tier.recompute_s_per_block is None
    run(second, prompts(seed=9, n=1))  # a prompt of its own: what computing a block costs here
    per_block = tier.recompute_s_per_block
    assert per_block is not None and 0 < per_block < 1
    run(second, [prompts(seed=9, n=1)[0][:58]])  # a prefix hit of 56 tokens: 2 prompt tokens computed, then decode
    assert tier.recompute_s_per_block == per_block  # steps without a block of prompt say nothing of it
    assert tier.stats.estimate_fetch_s(1) is None  # its reads so far found nothing: no estimate from them
    tier.stats.fetched(1e3, 1)  # a read measured at minutes (as of a remote store across a slow link)
    calls = tier.stats.read_calls
    req = eng.add_request(prompts()[0], SamplingParams.greedy(N_NEW))
    assert not eng.store.is_held(req.request_id) and tier.reads_skipped_recompute == 1
    assert tier.requests_waited == 1  # (only the first request of its own, before any step was timed)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.outputs[0].token_ids for o in outs] == expected[:1]
    assert tier.stats.read_calls == calls + 1  # read behind it all the same
    eng.kv.check_integrity()
    eng.store.close()


def test_writes_queued_at_exit_reach_the_store(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A replica that exits without closing its engine still writes what it had queued (for a few
    seconds at most): restarted right after, it gets those blocks back."""
    script = f"""
import random
from kvpool.core.events import MEDIUM_STORE, BlockRemoved, BlockStored
from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
llm = LLM({str(tiny_llama_dir)!r}, dtype="float32", skip_tokenizer_init=True, block_size={BS}, num_blocks=64,
          num_host_blocks=64, write_through=True, kv_store="file://{tmp_path}/store")
rng = random.Random(0)
llm.generate([[rng.randrange(256) for _ in range(61)] for _ in range(3)], SamplingParams.greedy(2), use_tqdm=False)
print("queued", llm.engine.store.tier.blocks_written)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    queued = int(out.stdout.split()[-1])
    assert queued > 0
    assert len([p for p in (tmp_path / "store").rglob("*") if p.is_file()]) == queued


@pytest.mark.parametrize("deadline", [float("nan"), -1.0, 0, True])
def test_the_store_refuses_a_deadline_that_would_never_fire(deadline: float, tmp_path: Path) -> None:
    """Checked by the store itself too (for callers that build it without the engine's config): a NaN
    deadline passed `<= 0` and never fired, so requests waited on every store read."""
    from types import SimpleNamespace

    from kvpool.store.engine_store import EngineStore

    kv = SimpleNamespace(host=object())  # (the deadline is checked before the tiers are looked at)
    with pytest.raises(ValueError, match=r"^kv_store_deadline: must be > 0 seconds, got "):
        EngineStore(f"file://{tmp_path}", kv, [object()], tmp_path, 16, deadline_s=deadline)  # type: ignore[arg-type]


def test_a_request_asking_for_prompt_logprobs_is_not_held_for_reads_it_cannot_use(
        tiny_llama_dir: Path, tmp_path: Path, expected: list[list[int]]) -> None:
    """Its prompt is computed whole (a cached block holds no logits): waiting for the store's copy of its
    blocks would only delay it. A request without them, behind it, still reads them."""
    url = f"file://{tmp_path}"
    first = make(tiny_llama_dir, url)
    run(first, prompts())
    first.engine.store.close()
    second = make(tiny_llama_dir, url)
    eng = second.engine
    scored = eng.add_request(prompts()[0], SamplingParams.greedy(N_NEW, prompt_logprobs=0))
    assert not eng.store.is_held(scored.request_id)
    plain = eng.add_request(prompts()[1], SamplingParams.greedy(N_NEW))
    assert eng.store.is_held(plain.request_id)
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert [outs[r.request_id].token_ids for r in (scored, plain)] == expected[:2]
    assert outs[scored.request_id].num_cached_tokens == 0 and outs[plain.request_id].num_cached_tokens == 60
    assert len(outs[scored.request_id].prompt_logprobs) == 61
    eng.kv.check_integrity()
    eng.store.close()
