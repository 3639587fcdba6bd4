"""The store tier against real backends: a directory on disk and a real redis-server process.

Round trips in one call per batch; a corrupted value, a value under another fingerprint, a torn file and
a killed server all read back as misses (never wrong bytes), and the store is used again once the server
is back."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import redis as redis_py

from kvpool.store import BlockStore, Fingerprint, KVStore, decode_value, encode_value, open_store
from kvpool.store.file_store import FileStore
from kvpool.store.server import RedisServer
from kvpool.store.worker import StoreWorker

FP = Fingerprint(model="tiny-weights-0", dtype="float32", block_size=16, group=0, layout="L2:2x16x2x16")


def blocks(n: int, size: int = 4096, salt: bytes = b"") -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(n):
        h = hashlib.sha256(salt + i.to_bytes(4, "little")).digest()
        out.append((h, os.urandom(size)))
    return out


@pytest.fixture(params=["file", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> KVStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/store")
    return open_store(request.getfixturevalue("redis_server").url)


def test_round_trip_batched(backend: KVStore) -> None:
    bs = BlockStore(backend, FP)
    data = blocks(20)
    assert bs.put(data)
    assert bs.stats.round_trips == 1 and bs.stats.blocks_written == 20
    got = bs.get([h for h, _ in data] + [b"\x00" * 32])
    assert got[:20] == [p for _, p in data] and got[20] is None
    assert bs.stats.round_trips == 2  # one MGET / one batch for 21 blocks
    assert (bs.stats.hits, bs.stats.misses, bs.stats.corrupt) == (20, 1, 0)
    assert bs.stats.bytes_read >= 20 * 4096
    assert bs.exists([data[0][0], b"\x01" * 32]) == [True, False]
    assert bs.stats.as_dict()["round_trips"] == 3
    est = bs.stats.estimate_fetch_s(20 * 4096)
    assert est is not None and 0 < est < 5.0
    assert bs.prefix_length([data[0][0], data[1][0], b"\x02" * 32, data[3][0]]) == 2


def test_corrupt_value_is_a_miss(backend: KVStore) -> None:
    bs = BlockStore(backend, FP)
    (h, p), (h2, p2) = blocks(2)
    bs.put([(h, p), (h2, p2)])
    value = backend.get_many([FP.key(h)])[0]
    assert value is not None
    flipped = bytearray(value)
    flipped[len(flipped) // 2] ^= 0x40  # one bit in the payload
    backend.put_many([(FP.key(h), bytes(flipped))])
    assert bs.get([h, h2]) == [None, p2]
    assert bs.stats.corrupt == 1
    backend.put_many([(FP.key(h), value[: len(value) // 2])])  # torn
    assert bs.get([h]) == [None]


def test_other_fingerprint_never_reads_the_blocks(backend: KVStore) -> None:
    writer = BlockStore(backend, FP)
    data = blocks(3)
    writer.put(data)
    for other in (Fingerprint(**{**FP.__dict__, "dtype": "bfloat16"}),
                  Fingerprint(**{**FP.__dict__, "model": "tiny-weights-1"}),
                  Fingerprint(**{**FP.__dict__, "block_size": 32}),
                  Fingerprint(**{**FP.__dict__, "format_version": 2})):
        assert BlockStore(backend, other).get([h for h, _ in data]) == [None] * 3
    # Even a value copied under the other fingerprint's key is rejected by its header.
    other = Fingerprint(**{**FP.__dict__, "layout": "L3:2x16x2x16"})
    h, _ = data[0]
    backend.put_many([(other.key(h), backend.get_many([FP.key(h)])[0])])  # type: ignore[list-item]
    reader = BlockStore(backend, other)
    assert reader.get([h]) == [None] and reader.stats.corrupt == 1


def test_value_of_another_block_is_a_miss() -> None:
    (h, p), (h2, _) = blocks(2)
    assert decode_value(FP, h, encode_value(FP, h, p)) == p
    assert decode_value(FP, h2, encode_value(FP, h, p)) is None


def test_file_store_writes_are_atomic(tmp_path: Path) -> None:
    fs = FileStore(tmp_path)
    bs = BlockStore(fs, FP)
    data = blocks(5)
    bs.put(data)
    assert not [p for p in tmp_path.rglob(".tmp-*")], "temporary files left behind"
    # A second process (a restarted replica) reads what the first wrote.
    assert BlockStore(open_store(f"file://{tmp_path}"), FP).get([h for h, _ in data]) == [p for _, p in data]


def test_bad_urls_name_the_field() -> None:
    for url, why in (("nowhere", "not a URL"), ("s3://bucket/x", "unknown scheme"), ("file://host/x", "local path"),
                     ("redis://:6379", "no host"), ("redis://nohost:99999", "out of range"),
                     ("redis://h:1/0?ttl=0", "ttl must be >= 1"), ("redis://h:1/0?ttl=-5", "ttl must be >= 1"),
                     ("redis://h:1/-1", "database must be >= 0"),
                     ("redis://h:1/0?tl=5", r"unknown option\(s\) \['tl'\]")):
        with pytest.raises(ValueError, match=rf"^kv_store: .*{why}"):
            open_store(url)


def test_percent_encoded_credentials_reach_the_server(redis_server: RedisServer) -> None:
    """A password with '@' is written %40 in a URL; the server must get the password itself."""
    redis_py.Redis(port=redis_server.port).execute_command("CONFIG", "SET", "requirepass", "p@ss:w")
    store = open_store(f"redis://:p%40ss%3Aw@127.0.0.1:{redis_server.port}/0")
    store.ping()  # (raises StoreError on a failed AUTH)
    store.close()


def test_file_store_files_follow_the_umask_so_other_users_can_read_them(tmp_path: Path) -> None:
    fs = FileStore(tmp_path)
    BlockStore(fs, FP).put(blocks(1))
    (f,) = [p for p in tmp_path.rglob("*") if p.is_file()]
    mask = os.umask(0)
    os.umask(mask)
    assert f.stat().st_mode & 0o777 == 0o666 & ~mask


def test_file_store_permission_errors_are_refusals_and_misses_not_an_outage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory this user may not write, or one file it may not read (another user's, as root never
    sees in a test: raised here), is not a store that is down: no back-off, no reconnect log loop."""
    bs = BlockStore(FileStore(tmp_path), FP)
    data = blocks(2)
    bs.put(data)
    unreadable = bs.store._path(FP.key(data[0][0]))  # type: ignore[attr-defined]

    def denied(name: str) -> None:
        """Path.<name> raises EACCES for the one file, as for another user's file."""
        real = getattr(Path, name)

        def method(self: Path) -> object:
            if self == unreadable:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self)

        monkeypatch.setattr(Path, name, method)

    from kvpool.store import file_store

    real_read = file_store._read_regular

    def read(path: Path) -> bytes | None:
        if path == unreadable:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    monkeypatch.setattr(file_store, "_read_regular", read)
    assert bs.get([h for h, _ in data]) == [None, data[1][1]] and bs.available
    # The same file's directory not searchable: `is_file` raises (Python 3.11) where EXISTS looks (the
    # reads of hybrid models): a miss for that key, not the store down for a second.
    denied("is_file")
    assert bs.exists([h for h, _ in data]) == [False, True] and bs.available and bs.stats.errors == 0
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(30, "Read-only file system")))
    assert not bs.put(blocks(1, salt=b"x"))
    assert bs.available and bs.stats.errors == 1  # refused (no back-off): reads go on
    assert not list(tmp_path.rglob(".tmp-*"))


def test_what_is_not_a_value_file_is_a_miss_for_its_key_only(tmp_path: Path) -> None:
    """A folder where a value should be failed the whole merged read and marked the store down (EISDIR);
    a FIFO there blocked the store's thread for good (a read waits for a writer). Now each is a miss for
    its key, and the store stays up."""
    bs = BlockStore(FileStore(tmp_path), FP)
    data = blocks(4)
    bs.put(data)
    paths = [bs.store._path(FP.key(h)) for h, _ in data]  # type: ignore[attr-defined]
    paths[1].unlink()
    paths[1].mkdir()
    paths[2].unlink()
    os.mkfifo(paths[2])
    paths[3].unlink()
    t0 = time.monotonic()
    got = bs.get([h for h, _ in data])
    assert time.monotonic() - t0 < 5
    assert got == [data[0][1], None, None, None] and bs.available and bs.stats.errors == 0
    assert bs.exists([h for h, _ in data]) == [True, False, False, False]


def test_worker_merges_queued_reads_into_one_round_trip(tmp_path: Path) -> None:
    """Reads queued while the worker is busy go out together, each block once: a burst of requests on a
    slow store costs one round trip, not one each in a row."""
    data = blocks(6)
    BlockStore(FileStore(tmp_path), FP).put(data)
    calls: list[int] = []
    busy = threading.Event()

    class Counting(FileStore):
        def put_many(self, items):  # type: ignore[no-untyped-def]
            busy.wait(5)  # holds the worker while the reads queue up
            super().put_many(items)

        def get_many(self, keys):  # type: ignore[no-untyped-def]
            calls.append(len(keys))
            return super().get_many(keys)

    w = StoreWorker(BlockStore(Counting(tmp_path), FP))
    w.write(blocks(1, salt=b"w"))
    time.sleep(0.2)
    hs = [h for h, _ in data]
    futs = [w.fetch(hs[i:i + 3]) for i in range(4)]  # overlapping: blocks 0-5, some asked twice
    busy.set()
    assert [f.result(5) for f in futs] == [[p for _, p in data[i:i + 3]] for i in range(4)]
    assert calls == [6]
    w.close()


def held_worker(tmp_path: Path) -> tuple[StoreWorker, threading.Event]:
    """A worker whose writes wait at a gate (set it to let them through), room for 4 blocks of 4 KiB, one
    block a write."""
    gate = threading.Event()

    class Held(FileStore):
        def put_many(self, items):  # type: ignore[no-untyped-def]
            gate.wait(5)
            super().put_many(items)

    return StoreWorker(BlockStore(Held(tmp_path), FP), max_pending_bytes=4 * 4096, max_batch=1), gate


def test_worker_bounds_its_write_queue_in_bytes_and_counts_only_dropped_blocks(tmp_path: Path) -> None:
    w, gate = held_worker(tmp_path)
    first = blocks(1, salt=b"first")
    assert w.write(first) == 1
    time.sleep(0.2)  # the worker takes it and waits at the gate
    # The block being written still holds its bytes: 3 more fit.
    assert w.write(blocks(5)) == 3 and w.stats.dropped_puts == 2
    # Again: the 4 queued already are not counted, the 2 that did not fit are dropped again.
    assert w.write(first + blocks(5)) == 0 and w.stats.dropped_puts == 4
    gate.set()
    assert w.flush(5)
    assert w.write(blocks(5, salt=b"later")) == 4  # room again once written
    w.close()


def test_worker_hands_back_the_tags_of_the_blocks_the_store_took_only(tmp_path: Path) -> None:
    w, gate = held_worker(tmp_path)
    first, more = blocks(1, salt=b"first"), blocks(5)
    assert w.write(first, ["first"]) == 1
    time.sleep(0.2)  # the worker takes it and waits at the gate
    assert w.write(more, [f"m{i}" for i in range(5)]) == 3  # m3 and m4 dropped: the queue is full
    assert w.write(first, ["again"]) == 0  # being written already: not queued, its tag neither
    assert w.take_written() == [] and not w.has_written()
    gate.set()
    assert w.flush(5)
    assert w.take_written() == ["first", "m0", "m1", "m2"] and w.take_written() == []
    with pytest.raises(ValueError, match="tags"):
        w.write(more, ["one"])
    w.close()


def test_killed_server_gives_misses_then_reconnects(redis_server: RedisServer) -> None:
    bs = BlockStore(open_store(redis_server.url), FP, retry_after_s=0.2)
    first, later = blocks(4), blocks(4, salt=b"later")
    assert bs.put(first)
    redis_server.kill()
    t0 = time.perf_counter()
    assert bs.get([h for h, _ in first]) == [None] * 4  # a miss, not an exception
    assert not bs.put(later)
    assert time.perf_counter() - t0 < 3.0, "a dead store must cost little"
    assert bs.stats.errors >= 1 and not bs.available
    assert bs.get([first[0][0]]) == [None]  # backing off: not even tried
    assert bs.stats.skipped >= 1
    redis_server.start()  # same port, empty (no persistence)
    time.sleep(0.25)
    assert bs.put(later)
    assert bs.available
    assert bs.get([h for h, _ in later]) == [p for _, p in later]


def wait_for(what: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_store_down_at_start_is_reported_at_start_and_used_once_up(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvpool.store.base")
    redis_server.kill()  # nothing answers on its port yet
    w = StoreWorker(BlockStore(open_store(redis_server.url), FP, retry_after_s=0.2))
    try:
        wait_for(lambda: not w.store.available)  # the probe at start, with no traffic at all
        assert f"KV store {redis_server.url}/0: connect failed" in caplog.text
        assert w.stats.round_trips == 0 and w.stats.errors == 0  # probes are not traffic, nor errors
        redis_server.start()
        wait_for(lambda: w.store.available)  # probed again while down: back without any traffic
        assert "reachable again" in caplog.text
        assert w.stats.round_trips == 0  # probes are not traffic
        data = blocks(3)
        assert w.write(data) == 3 and w.flush(5)
        assert w.fetch([h for h, _ in data]).result(5) == [p for _, p in data]
    finally:
        w.close()


def test_a_host_that_does_not_resolve_is_reported_at_start(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvpool.store.base")
    w = StoreWorker(BlockStore(open_store("redis://no-such-host.invalid:6379"), FP))
    try:
        wait_for(lambda: not w.store.available)
        assert "KV store redis://no-such-host.invalid:6379/0: connect failed" in caplog.text
        assert w.fetch([blocks(1)[0][0]]).result(5) == [None]  # a miss, never an exception
    finally:
        w.close()


def test_full_server_drops_writes_without_failing(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvpool.store.base")
    redis_server.stop()
    small = RedisServer(redis_server.binary, maxmemory="2mb").start()
    try:
        bs = BlockStore(open_store(small.url), FP, retry_after_s=60.0)
        ok = [bs.put(blocks(8, size=64 << 10, salt=bytes([i]))) for i in range(8)]
        assert ok[0] and not all(ok), "the server should refuse writes past maxmemory"
        assert bs.stats.errors >= 2 and bs.stats.skipped == 0  # each refused write was tried: no back-off
        assert bs.available and bs.probe()  # full is not down: reads go on
        assert caplog.text.count("put refused") == 1 and "failed" not in caplog.text  # one warning, no flapping
        assert bs.get([blocks(8, size=16, salt=b"\x00")[0][0]])[0] is not None  # reads still work
    finally:
        small.stop()


def test_worker_keeps_io_off_the_caller(redis_server: RedisServer) -> None:
    w = StoreWorker(BlockStore(open_store(redis_server.url), FP), max_batch=16)
    data = blocks(40)
    t0 = time.perf_counter()
    assert w.write(data) == 40
    assert w.write(data[:5]) == 0  # already queued: not written twice
    assert time.perf_counter() - t0 < 0.05
    assert w.flush(5)
    assert w.stats.round_trips == 3  # 40 blocks in batches of 16
    fut = w.fetch([h for h, _ in data[:10]])
    assert fut.result(5) == [p for _, p in data[:10]]
    redis_server.kill()
    assert w.fetch([data[0][0]]).result(5) == [None]
    w.close()
    assert w.fetch([data[0][0]]).result(0) == [None]


def test_worker_drops_writes_when_its_queue_is_full(tmp_path: Path) -> None:
    class Slow(FileStore):
        def put_many(self, items):  # type: ignore[no-untyped-def]
            time.sleep(0.2)
            super().put_many(items)

    w = StoreWorker(BlockStore(Slow(tmp_path), FP), max_pending_writes=4, max_batch=4)
    queued = w.write(blocks(4)) + w.write(blocks(20, salt=b"more"))
    assert queued < 24 and w.stats.dropped_puts == 24 - queued
    w.close()


def test_redis_client_sees_framed_values(redis_server: RedisServer) -> None:
    bs = BlockStore(open_store(redis_server.url), FP)
    (h, p), = blocks(1)
    bs.put([(h, p)])
    raw = redis_py.Redis(port=redis_server.port).get(FP.key(h))
    assert raw is not None and raw.startswith(b"KVPB") and p in raw


def test_a_bounded_file_store_evicts_the_least_recently_used_values(tmp_path: Path) -> None:
    """`file:///dir?max_size=SIZE`: past the bound, the values least recently written or read are deleted
    (a read touches its file, so the order holds across a restart); without one, the disk fills up."""
    keys = [f"kvpool:fp:{i:04x}".encode() for i in range(6)]
    store = open_store(f"file://{tmp_path}?max_size=1000B")
    assert isinstance(store, FileStore) and store.max_bytes == 1000
    store.put_many([(k, bytes(300)) for k in keys[:3]])  # 900 bytes
    assert store.get_many(keys[:1]) == [bytes(300)]  # key 0 is now the most recently used
    store.put_many([(keys[3], bytes(300))])  # 1200 > 1000: key 1, the least recently used, goes
    assert store.exists_many(keys[:4]) == [True, False, True, True] and store.evicted == 1
    assert not store._path(keys[1]).exists()  # type: ignore[attr-defined]
    # A restart reads the order from the files' times: key 2 is now the oldest.
    time.sleep(0.01)
    store.get_many([keys[0]])
    again = open_store(f"file://{tmp_path}?max_size=1000B")
    again.put_many([(keys[4], bytes(300))])
    assert again.exists_many(keys[:5]) == [True, False, False, True, True]
    # A smaller bound at start evicts at once; a value larger than the bound is not kept.
    small = open_store(f"file://{tmp_path}?max_size=400B")
    assert sum(small.exists_many(keys)) == 1
    small.put_many([(keys[5], bytes(500))])
    assert small.exists_many([keys[5]]) == [False]
    with pytest.raises(ValueError, match=r"kv_store: unknown option\(s\) \['size'\] .*max_size=SIZE"):
        open_store(f"file://{tmp_path}?size=1GiB")
    with pytest.raises(ValueError, match=r"kv_store: max_size: cannot read 'lots' as a size"):
        open_store(f"file://{tmp_path}?max_size=lots")


def test_clear_deletes_kvpool_values_only(backend: KVStore, tmp_path: Path) -> None:
    """What `bench cluster` runs between systems on a user's --kv-store: every fingerprint's values go, and
    whatever else the folder or database holds stays."""
    other = Fingerprint(model="other", dtype="bfloat16", block_size=16, group=1, layout="x")
    for fp, n in ((FP, 5), (other, 3)):
        assert BlockStore(backend, fp).put(blocks(n))
    if isinstance(backend, FileStore):
        (backend.root / "thesis.tex").write_text("mine")
        (backend.root / "ab").mkdir(exist_ok=True)
        (backend.root / "ab" / "notes.txt").write_text("mine too")
        (backend.root / "photos").mkdir()
        keep = {"thesis.tex", "ab", "ab/notes.txt", "photos"}
    else:
        client = redis_py.Redis.from_url(backend.url)
        client.set(b"user:session", b"mine")
        keep = set()
    assert backend.clear() == 8
    assert BlockStore(backend, FP).get([h for h, _ in blocks(5)]) == [None] * 5
    if isinstance(backend, FileStore):
        assert {str(p.relative_to(backend.root)) for p in backend.root.rglob("*")} == keep
    else:
        assert client.get(b"user:session") == b"mine" and client.dbsize() == 1
    assert backend.clear() == 0
