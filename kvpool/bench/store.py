"""`kvpool bench store`: the store tier's backends with real block sizes: write and read throughput, latency
per batched round trip, and the break-even against recomputing the blocks.

Blocks are the size a model's block has in the store (K and V of every layer; default SmolLM2-135M in
float32, 16 tokens: 720 KiB). Each backend gets `--blocks` blocks written in batches of `--batch` (one
pipeline each) and read back in batches (one MGET each, verified by checksum). `redis` starts a private
redis-server on a free loopback port unless `--redis-url` names one. The break-even compares the measured
read time per block with `--recompute-ms-per-block` (the time a replica takes to prefill one block; give
your own, the default is what a 1-thread CPU replica of SmolLM2 measured here): below it, a store hit
beats recomputing; above it, the engine should not wait on the store (LMCache issue 914).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from kvpool.bench.report import emit, format_table, name_list
from kvpool.server.options import _positive, _positive_float

BACKENDS = ("file", "redis")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default="file,redis", help="comma-separated: file, redis")
    p.add_argument("--blocks", type=_positive, default=256)
    p.add_argument("--batch", type=_positive, default=16, help="blocks per round trip")
    p.add_argument("--block-bytes", type=_positive, default=2 * 16 * 3 * 64 * 4 * 30,
                   help="bytes of one block (default: SmolLM2-135M, float32, 16 tokens)")
    p.add_argument("--redis-url", default=None, help="an existing server (default: start one on loopback)")
    p.add_argument("--dir", default=None, help="directory of the file backend (default: a temporary one)")
    p.add_argument("--recompute-ms-per-block", type=_positive_float, default=100.0,
                   help="what recomputing one block costs, to compare reads with")
    p.add_argument("--json", action="store_true")


def bench_backend(url: str, a: argparse.Namespace) -> dict[str, Any]:
    from kvpool.store import BlockStore, Fingerprint, open_store

    fp = Fingerprint(model="bench", dtype="float32", block_size=16)
    bs = BlockStore(open_store(url), fp)
    if not bs.probe():  # (a store that cannot be reached is the flag's fault: one line, not a traceback)
        bs.close()
        raise ValueError(f"store: cannot reach {url}")
    payload = os.urandom(a.block_bytes)
    hashes = [i.to_bytes(8, "little") + os.urandom(24) for i in range(a.blocks)]
    batches = [hashes[i:i + a.batch] for i in range(0, len(hashes), a.batch)]
    t0 = time.perf_counter()
    for b in batches:
        if not bs.put([(h, payload) for h in b]):
            raise OSError(f"{url}: writes failed ({bs.stats.errors} errors)")
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    hits = 0
    for b in batches:
        hits += sum(p is not None for p in bs.get(b))
    read_s = time.perf_counter() - t0
    st = bs.stats.as_dict()
    bs.close()
    mib = a.blocks * a.block_bytes / 2**20
    read_ms_block = 1e3 * read_s / a.blocks
    return {"url": url, "blocks": a.blocks, "batch": a.batch, "block_bytes": a.block_bytes, "hits": hits,
            "write_mib_per_s": mib / write_s, "read_mib_per_s": mib / read_s,
            "write_ms_per_round_trip": 1e3 * write_s / len(batches),
            "read_ms_per_round_trip": 1e3 * read_s / len(batches),
            "read_ms_per_block": read_ms_block, "round_trips": st["round_trips"], "bytes_written": st["bytes_written"],
            "bytes_read": st["bytes_read"], "faster_than_recompute": read_ms_block < a.recompute_ms_per_block}


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvpool.store.server import RedisServer, find_server_binary

    names = name_list("backends", a.backends, BACKENDS)
    if a.redis_url is not None and "redis" not in names:
        raise ValueError("redis_url: only the redis backend reads it; add redis to --backends")
    if a.dir is not None and "file" not in names:
        raise ValueError("dir: only the file backend reads it; add file to --backends")
    out: dict[str, Any] = {"backends": {}}
    server = None
    try:
        for name in names:
            if name == "file":
                with tempfile.TemporaryDirectory(dir=a.dir) as d:
                    out["backends"]["file"] = bench_backend(f"file://{d}", a)
            elif name == "redis":
                url = a.redis_url
                if url is None:
                    binary = find_server_binary()
                    if binary is None:
                        raise ValueError("backends: no redis-server or valkey-server here; pass --redis-url")
                    server = RedisServer(binary).start()
                    url = server.url
                try:
                    out["backends"]["redis"] = bench_backend(url, a)
                except ValueError as e:  # (the store's own checks name `kv_store`; here the flag is --redis-url)
                    msg = str(e)
                    if a.redis_url is None or not msg.startswith("kv_store:"):
                        raise
                    raise ValueError("redis_url:" + msg[len("kv_store:"):]) from None
    finally:
        if server is not None:
            server.stop()
    rows = [[n, f"{r['write_mib_per_s']:.0f}", f"{r['read_mib_per_s']:.0f}", f"{r['write_ms_per_round_trip']:.1f}",
             f"{r['read_ms_per_round_trip']:.1f}", f"{r['read_ms_per_block']:.2f}", str(r["round_trips"]),
             str(r["faster_than_recompute"])] for n, r in out["backends"].items()]
    table = format_table(["backend", "write MiB/s", "read MiB/s", "write ms/trip", "read ms/trip", "read ms/block",
                          "round trips", f"< recompute ({a.recompute_ms_per_block:g} ms)"], rows)
    emit(table, out, a.json)
    return out
