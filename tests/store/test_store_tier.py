"""The store tier's engine glue with real parts: the core's host pool, real host tensors, a real store
(directory, or a redis-server process) and the background worker.

A replica's sheltered blocks are written through to the store; a restarted replica (new pool, zeroed
tensors) asked for those hashes reads them in the background, the request waits until they land in host
blocks (bit-identical), or until its own deadline when the store is slow or dead; a chain stops at the first
missing block; two requests for the same blocks share one read; a store slower than recomputing is not read.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvpool.core.host_pool import HostBlockPool
from kvpool.store import BlockStore, Fingerprint, open_store
from kvpool.store.base import StoreStats
from kvpool.store.blocks import block_nbytes, gather
from kvpool.store.engine_store import prompt_step
from kvpool.store.file_store import FileStore
from kvpool.store.server import RedisServer
from kvpool.store.tier import StoreTier
from kvpool.store.worker import StoreWorker

FP = Fingerprint(model="m", dtype="float32", block_size=16, layout="L2")
H = [hashlib.sha256(bytes([i])).digest() for i in range(6)]


def caches(n: int, fill: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    mk = (lambda: torch.randn((2, n, 16, 8), generator=g)) if fill else (lambda: torch.zeros((2, n, 16, 8)))
    return [(mk(), mk()) for _ in range(2)]


def tier(url: str, **kw: object) -> StoreTier:
    return StoreTier(StoreWorker(BlockStore(open_store(url), FP, retry_after_s=0.1)), **kw)  # type: ignore[arg-type]


def write_replica(url: str, hashes: list[bytes]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replica A: shelter blocks in its host tier (as the swap plan would), run the 'copies', write through."""
    pool = HostBlockPool(8)
    cs = caches(8, fill=True)
    t = tier(url)
    pairs = []
    for i, h in enumerate(hashes):
        hb = pool.shelter(h)
        assert hb is not None
        pairs.append((100 + i, hb.block_id))  # (device block, host block)
    ids = [hb for _, hb in pairs]
    assert t.write(list(zip([pool.blocks[i].block_hash for i in ids], gather(cs, ids), strict=True))) == len(hashes)
    assert t.worker.flush(5)
    t.close()
    return [(k[:, [hb for _, hb in pairs]], v[:, [hb for _, hb in pairs]]) for k, v in cs]


def land_all(t: StoreTier, pool: HostBlockPool, cs: list, timeout: float = 5.0) -> int:
    n, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline and t._fetches:
        n += t.land(pool.shelter, pool.free_blocks, cs, pool.unshelter)
        time.sleep(0.01)
    return n


def test_restarted_replica_gets_its_blocks_back(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    written = write_replica(url, H[:4])
    pool, cs = HostBlockPool(8), caches(8, fill=False)
    t = tier(url)
    assert t.request_arrived("r1", H[:4])
    assert t.request_arrived("r2", H[:3])  # the same blocks: no second read
    assert t.stats.round_trips <= 1 and len(t._fetches) == 1
    assert land_all(t, pool, cs) == 4
    assert t.ready("r1") and t.ready("r2") and t.requests_timed_out == 0
    ids = [pool.cached[h].block_id for h in H[:4]]
    for (wk, wv), (k, v) in zip(written, cs, strict=True):
        assert torch.equal(k[:, ids], wk) and torch.equal(v[:, ids], wv)
    pool.check_integrity()
    assert pool.get_num_free_blocks() == 8  # released after writing: ordinary cached host blocks
    t.close()


def test_chain_stops_at_the_first_miss(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    write_replica(url, [H[0], H[2]])
    pool, cs = HostBlockPool(8), caches(8, fill=False)
    t = tier(url)
    t.request_arrived("r", H[:3])
    assert land_all(t, pool, cs) == 1 and set(pool.cached) == {H[0]}
    t.close()


def test_deadline_when_the_store_is_slow(tmp_path: Path) -> None:
    class Slow(FileStore):
        def get_many(self, keys):  # type: ignore[no-untyped-def]
            time.sleep(1.0)
            return super().get_many(keys)

    now = [0.0]
    t = StoreTier(StoreWorker(BlockStore(Slow(tmp_path), FP)), deadline_s=0.5, clock=lambda: now[0])
    assert t.request_arrived("r", H[:2])
    assert not t.ready("r")
    now[0] = 0.6
    assert t.ready("r") and t.requests_timed_out == 1  # computes itself; the read lands later for others
    t.close()


def test_dead_store_never_holds_a_request(redis_server: RedisServer) -> None:
    write_replica(redis_server.url, H[:2])
    redis_server.kill()
    pool, cs = HostBlockPool(4), caches(4, fill=False)
    t = tier(redis_server.url)
    waited = t.request_arrived("r", H[:2])
    assert land_all(t, pool, cs) == 0
    assert t.ready("r") and t.requests_timed_out == 0  # the read failed fast: a miss, not a wait
    # Found down by the worker's probe at start (then the request does not even wait), or by the read.
    assert not t.worker.store.available
    if waited:
        assert t.stats.errors + t.stats.skipped >= 1
    assert not t.request_arrived("r2", H[:2])  # known down: nobody waits on it until it answers again
    t.close()


def test_store_slower_than_recompute_is_not_waited_on(tmp_path: Path) -> None:
    """A read expected to take longer than computing the blocks holds no request (LMCache issue 914); it
    still goes out behind the request, so the blocks land for later ones."""
    url = f"file://{tmp_path}"
    write_replica(url, H[:4])
    cs = caches(4, fill=False)
    pool = HostBlockPool(4)
    t = tier(url, block_bytes=block_nbytes(cs), recompute_s_per_block=1e-9)
    assert t.request_arrived("warm", H[:2])  # the first read measures the store: nothing known, it waits
    assert land_all(t, pool, cs) == 2
    assert not t.request_arrived("r", H[2:4]) and t.reads_skipped_slow == t.reads_skipped_recompute == 1
    assert t.ready("r") and t.requests_waited == 1
    assert land_all(t, pool, cs) == 2  # read behind it: landed for the next request
    assert set(pool.cached) == set(H[:4])
    t.recompute_s_per_block = 1e3  # computing is slower than any read: requests wait again
    assert t.request_arrived("r2", H[4:6]) and t.requests_waited == 2
    t.close()


def test_the_fetch_estimate_follows_recent_reads_that_found_something() -> None:
    """Reads of misses move no bytes and say nothing of what reading blocks costs; one slow read is
    forgotten as fast reads follow (a moving average, not the mean since start)."""
    st = StoreStats()
    assert st.estimate_fetch_s(100) is None
    st.fetched(0.5, 0)  # all misses
    assert st.estimate_fetch_s(100) is None
    st.fetched(0.01, 100)
    assert st.estimate_fetch_s(100) == pytest.approx(0.01)
    assert st.estimate_fetch_s(300) == pytest.approx(0.03)  # beyond a mean-sized read: by the bytes
    assert st.estimate_fetch_s(10) == pytest.approx(0.01)  # at least one round trip
    assert st.estimate_fetch_s(100, round_trips=2) == pytest.approx(0.02)
    st.fetched(1.0, 100)  # one slow read
    assert st.estimate_fetch_s(100) == pytest.approx(0.01 + StoreStats.FETCH_EWMA * 0.99)
    for _ in range(15):
        st.fetched(0.01, 100)
    assert st.estimate_fetch_s(100) < 0.02


def test_only_steps_of_prompt_tokens_are_timed() -> None:
    def sched(*rows: tuple[int, int, int]) -> list[SimpleNamespace]:  # (start_pos, new tokens, prompt length)
        return [SimpleNamespace(start_pos=a, num_new_tokens=n, request=SimpleNamespace(num_prompt_tokens=p))
                for a, n, p in rows]

    assert prompt_step(sched((0, 64, 64)), 16)
    assert prompt_step(sched((0, 64, 64), (70, 1, 60)), 16)  # one decode row beside it: 98% prompt
    assert not prompt_step(sched((0, 16, 16), *[(70, 1, 60)] * 40), 16)  # 40 decode rows: their time mostly
    assert not prompt_step(sched((0, 15, 15)), 16)  # less than a block
    assert prompt_step(sched((48, 16, 100)), 16)  # a middle chunk of a prompt
    assert not prompt_step(sched((100, 1, 100)), 16)


def test_recompute_cost_is_a_moving_average_of_prompt_steps(tmp_path: Path) -> None:
    t = tier(f"file://{tmp_path}")
    assert t.recompute_s_per_block is None
    t.observe_compute(0.4, 4)
    assert t.recompute_s_per_block == pytest.approx(0.1)
    t.observe_compute(0.2, 1)  # one slow step moves it by COMPUTE_EWMA of the difference
    assert t.recompute_s_per_block == pytest.approx(0.1 + StoreTier.COMPUTE_EWMA * 0.1)
    t.observe_compute(0.0, 4)
    t.observe_compute(1.0, 0)
    assert t.recompute_s_per_block == pytest.approx(0.12)
    t.close()


def test_a_store_slower_than_the_deadline_stops_holding_requests_until_it_is_fast_again(tmp_path: Path) -> None:
    """After SLOW_AFTER requests in a row waited in vain, requests do not wait; one read still goes out
    behind them, and a read back within the deadline makes requests wait again."""
    url = f"file://{tmp_path}"
    write_replica(url, H[:6])
    gate = threading.Event()

    class Slow(FileStore):
        def get_many(self, keys):  # type: ignore[no-untyped-def]
            gate.wait(1.0)
            return super().get_many(keys)

    now = [0.0]
    pool, cs = HostBlockPool(8), caches(8, fill=False)
    t = StoreTier(StoreWorker(BlockStore(Slow(tmp_path), FP)), deadline_s=0.5, clock=lambda: now[0])
    for i in range(StoreTier.SLOW_AFTER):
        assert t.request_arrived(f"r{i}", H[2 * i:2 * i + 2])
        now[0] += 0.6
        assert t.ready(f"r{i}")
    assert t.slow and t.requests_timed_out == StoreTier.SLOW_AFTER
    # Slow: no wait, and no second read queued while one is out.
    fetches = len(t._fetches)
    assert not t.request_arrived("late", H[:2]) and t.ready("late") and len(t._fetches) == fetches
    gate.set()  # the store answers at once from now on
    land_all(t, pool, cs)  # the reads that were late land, but late: still slow
    assert t.slow
    assert not t.request_arrived("next", [hashlib.sha256(b"absent").digest()])  # one read goes out behind it
    assert len(t._fetches) == 1
    land_all(t, pool, cs)  # ... and comes back at once (the clock did not move)
    assert not t.slow  # back within the deadline: requests wait again
    assert t.request_arrived("r", [hashlib.sha256(b"absent2").digest()])
    t.close()
