"""The store tier inside an engine (`--kv-store URL`): the few calls the engine's step loop makes.

- `hold(request)` on arrival: the blocks past the request's device + host hit are read from the store in
  the background; a request with something to read is held out of the scheduler until they land or its
  deadline passes (`StoreTier`), so a running step never waits on the store.
- `pump()` at the start of every step: completed reads are written into host blocks (then found by the
  ordinary lookup as host hits and swapped in) and the requests whose reads are done come back, in arrival
  order, for the scheduler.
- `after_swaps(plan)` after the step's copies ran: the host blocks they filled are written through to the
  store (gathered at once; written by the store worker).

Supported where the host tier has one page type and the model one layer group (the full-attention models);
anything else is refused at start with a clear error, rather than caching a part of the state.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.store import BlockStore, open_store
from kvpool.store.blocks import block_nbytes, fingerprint
from kvpool.store.tier import StoreTier
from kvpool.store.worker import StoreWorker

if TYPE_CHECKING:
    from kvpool.core.kv_cache_manager import KVCacheManager
    from kvpool.core.swap import SwapPlan

log = logging.getLogger(__name__)


class EngineStore:
    def __init__(self, url: str, kv: KVCacheManager, host_caches: Any, model_dir: Path, block_size: int, *,
                 deadline_s: float = 2.0, kv_layout: str = "standard") -> None:
        if kv.host is None or not host_caches:
            raise ValueError("kv_store: the store sits below the host tier; give the engine one (--swap-space)")
        if kv.num_groups != 1 or kv.host.typed or len(kv.host.pools) != 1:
            raise ValueError("kv_store: supported for models with one layer group (full attention) for now")
        if deadline_s <= 0:
            raise ValueError(f"kv_store_deadline: must be > 0 seconds, got {deadline_s}")
        self.kv = kv
        self.caches = host_caches
        self.pool = kv.host.pools[0]
        self.block_size = block_size
        fp = fingerprint(model_dir, host_caches, block_size, kv_layout=kv_layout)
        self.tier = StoreTier(StoreWorker(BlockStore(open_store(url), fp)), deadline_s=deadline_s,
                              block_bytes=block_nbytes(host_caches))
        self.url = url
        self._held: OrderedDict[str, Any] = OrderedDict()
        log.info("KV store tier: %s (fingerprint %s)", url, fp.digest.hex())

    @property
    def stats(self) -> Any:
        return self.tier.stats

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def num_held(self) -> int:
        return len(self._held)

    def hold(self, req: Any) -> bool:
        """Start reading the request's blocks past its local hit; True when it must wait for them."""
        if not self.kv.enable_caching or not req.block_hashes:
            return False
        max_blocks = (len(req.all_token_ids) - 1) // self.block_size
        hashes = req.block_hashes[:max_blocks]
        # The same lookup the scheduler will make (device, then host), without touching stats or blocks.
        local = len(self.kv.managers[0].find_longest_cache_hit(hashes, max_blocks))
        if not self.tier.request_arrived(req.request_id, hashes[local:]):
            return False
        self._held[req.request_id] = req
        return True

    def pump(self) -> list[Any]:
        """Land completed reads in host blocks; the held requests that may be scheduled now, in order."""
        self.tier.land(self.pool.shelter, self.pool.free_blocks, self.caches)
        ready = [rid for rid in self._held if self.tier.ready(rid)]
        return [self._held.pop(rid) for rid in ready]

    def after_swaps(self, plan: SwapPlan) -> None:
        if plan.swap_out:
            blocks = self.pool.blocks
            self.tier.after_swaps(plan.swap_out, lambda h: blocks[h].block_hash, self.caches)

    def drop(self, request_id: str) -> Any | None:
        """Forget a held request (aborted before it was scheduled)."""
        self.tier.forget(request_id)
        return self._held.pop(request_id, None)

    def close(self) -> None:
        self.tier.close()


class StoreCollector:
    """Prometheus collector of an engine's store tier, read at scrape time (the counters live in the store
    worker's thread-safe stats; nothing is pushed from the step loop)."""

    def __init__(self, store: EngineStore, model_name: str) -> None:
        self.store = store
        self.labels = {"model_name": model_name}

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.store.stats.as_dict()
        tier = self.store.tier

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"kvpool:store_{name}", doc, labels=["model_name"])
            c.add_metric([self.labels["model_name"]], value)
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"kvpool:store_{name}", doc, labels=["model_name"])
            g.add_metric([self.labels["model_name"]], value)
            return g

        yield counter("round_trips", "Store calls (each one batched round trip).", st["round_trips"])
        yield counter("bytes_written", "Bytes written to the store.", st["bytes_written"])
        yield counter("bytes_read", "Bytes read from the store.", st["bytes_read"])
        yield counter("hit_blocks", "Blocks found in the store.", st["hits"])
        yield counter("miss_blocks", "Blocks looked up and not found (or unreadable).", st["misses"])
        yield counter("corrupt_blocks", "Values rejected by checksum or fingerprint (misses).", st["corrupt"])
        yield counter("errors", "Store calls that failed (down, slow, full).", st["errors"])
        yield counter("dropped_write_blocks", "Blocks not written: the write queue was full.", st["dropped_puts"])
        yield counter("latency_seconds", "Seconds spent in store calls (sum).", st["latency_total_s"])
        yield counter("landed_blocks", "Blocks read from the store into the host tier.", tier.blocks_landed)
        yield counter("request_deadlines", "Requests that stopped waiting for the store.", tier.requests_timed_out)
        yield gauge("requests_waiting", "Requests waiting for their store reads.", self.store.num_held())
        yield gauge("available", "1 while the store answers, 0 while backing off.", float(tier.worker.store.available))
