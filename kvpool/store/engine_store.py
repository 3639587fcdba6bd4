"""The store tier inside an engine (`--kv-store URL`): the few calls the engine's step loop makes.

- `hold(request)` on arrival: the blocks past the request's device + host hit are read from the store in
  the background; a request with something to read is held out of the scheduler until they land or its
  deadline passes (`StoreTier`), so a running step never waits on the store.
- `pump()` at the start of every step: completed reads are written into host blocks (then found by the
  ordinary lookup as host hits and swapped in) and the requests whose reads are done come back, in arrival
  order, for the scheduler.
- `after_swaps(plan)` after the step's copies ran: the host blocks they filled are written through to the
  store (gathered at once; written by the store worker).
- `times(scheduled)` / `step_computed(seconds, scheduled)` around a forward of (almost) only prompt tokens:
  what recomputing a block costs; a request is held for a read only while the store is faster.

Every model the host tier serves is served here. One layer group on one host pool (full-attention models)
keeps the original fast path: keys under the single-group fingerprint, one GET of the chain past the local
hit, landed as a chain. Several groups (sliding-window + full attention like Gemma-3; conv or Mamba states
+ attention like LFM2, whose pages differ in size and so live in one host pool per page type) go through
`kvpool.store.hybrid`: every group's sheltered blocks are written through under the host tier's per-group
keys and one fingerprint naming every group's layers and page layout; a read computes, on the worker
thread, the longest point every group can serve from its local tiers plus the store (one EXISTS), reads
exactly what that point needs (one GET), and lands each payload in the host pool of its page type. The
scheduler's own lookup then finds the hit in every group, or a shorter one if some value failed its
checksum; never a hit that one group cannot serve.
"""

from __future__ import annotations

import atexit
import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.core.block import group_key
from kvpool.core.events import MEDIUM_STORE, block_stored
from kvpool.store import BlockStore, open_store
from kvpool.store.blocks import block_nbytes, fingerprint, gather
from kvpool.store.hybrid import HitRule, HostPages, KVPages, ReadPlan, SlotPages, hit_point, hybrid_fingerprint
from kvpool.store.tier import StoreTier
from kvpool.store.worker import StoreWorker

if TYPE_CHECKING:
    from kvpool.core.kv_cache_manager import KVCacheManager
    from kvpool.core.swap import SwapPlan

log = logging.getLogger(__name__)


PROMPT_SHARE = 0.9  # of a timed step's tokens, at least this many are prompt tokens


def prompt_step(scheduled: Sequence[Any], block_size: int) -> bool:
    """Whether a step of these `ScheduledRequest`s tells what recomputing a block costs: a block or more of
    prompt tokens, and (almost) nothing else. Beside decode rows a step's time is mostly theirs, and
    dividing it among the prompt's blocks would make recomputing look dearer than it is, and so a store
    slower than recomputing worth waiting for (the LMCache 914 failure)."""
    total = sum(s.num_new_tokens for s in scheduled)
    prompt = sum(s.num_new_tokens for s in scheduled if s.start_pos < s.request.num_prompt_tokens)
    return prompt >= block_size and prompt >= PROMPT_SHARE * total


class EngineStore:
    def __init__(self, url: str, kv: KVCacheManager, host_caches: Any, model_dir: Path, block_size: int, *,
                 deadline_s: float = 2.0, kv_layout: str = "standard", host_pages: Sequence[Any] = (),
                 group_of_layer: Sequence[int] = (), tensor_of_layer: Sequence[int] = (), compute: str = "",
                 kv_events: bool = False) -> None:
        """`host_caches`: the runner's one-page-size host tensors (`host_kv_caches`); `host_pages`: a
        two-level host tier's per-page-type slot tensors (`host_pages`). `group_of_layer` /
        `tensor_of_layer` (the runner's `LayerLayout`) name each group's layers for the fingerprint of a
        multi-group model. `compute`: how the engine computes KV beyond its weights (model dtype, kernels),
        part of the fingerprint. `kv_events`: publish a `BlockStored` (medium STORAGE) for each block the
        store takes (`take_events`)."""
        if kv.host is None or not (host_caches or host_pages):
            raise ValueError("kv_store: the store sits below the host tier; give the engine one (--swap-space)")
        # (written so that NaN fails too: it compares false to everything, and a NaN deadline never fires)
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float) or not (
                math.isfinite(deadline_s) and deadline_s > 0):
            raise ValueError(f"kv_store_deadline: must be > 0 seconds, got {deadline_s}")
        self.kv = kv
        self.kv_events = kv_events
        self.caches = host_caches
        self.pool = kv.host.pools[0]
        self.block_size = block_size
        # One group on one host pool: the original path (its keys and fingerprint unchanged).
        self.hybrid = kv.num_groups != 1 or kv.host.typed or len(kv.host.pools) != 1
        if not self.hybrid:
            fp = fingerprint(model_dir, host_caches, block_size, kv_layout=kv_layout, compute=compute)
            block_bytes = block_nbytes(host_caches)
        else:
            # One HostPages per page type of the host tier, in its order.
            # (paged host memory whenever the runner keeps pages, typed plans or not: with every group's
            # page the same size the pool is one-level, and the runner's host KV tensors are empty)
            self.pages: list[HostPages] = ([SlotPages(slots) for slots in host_pages] if host_pages
                                           else [KVPages(host_caches, kv_layout)])
            if len(self.pages) != len(kv.host.pools):
                raise ValueError(f"kv_store: {len(self.pages)} host page types for {len(kv.host.pools)} host pools")
            if not group_of_layer or not tensor_of_layer:
                raise ValueError("kv_store: a model with several layer groups needs its layer layout "
                                 "(group_of_layer, tensor_of_layer) for the store's fingerprint")
            self.rules = [HitRule.of(s) for s in kv.specs]
            dtype = host_pages[0][0].dtype if host_pages else host_caches[0][0].dtype
            fp = hybrid_fingerprint(model_dir, dtype, block_size, kv.specs, group_of_layer, tensor_of_layer,
                                    kv.page_type, self.pages, compute)
            block_bytes = max(p.nbytes for p in self.pages)
        self.tier = StoreTier(StoreWorker(BlockStore(open_store(url), fp)), deadline_s=deadline_s,
                              block_bytes=block_bytes)
        self.url = url
        self._held: OrderedDict[str, Any] = OrderedDict()
        self._again: dict[str, float] = {}  # held requests that wait on others' reads -> their first deadline
        # Writes still queued at exit are flushed (for a few seconds at most): a replica restarted right
        # after it stopped gets its last blocks back from the store. A weak reference: registering does not
        # keep an engine alive.
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            me = ref()
            if me is not None:
                me.close()

        self._close_at_exit = close_at_exit
        atexit.register(close_at_exit)
        log.info("KV store tier: %s (fingerprint %s%s)", url, fp.digest.hex(),
                 f", {kv.num_groups} layer groups on {len(kv.host.pools)} host page types" if self.hybrid else "")

    @property
    def stats(self) -> Any:
        return self.tier.stats

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def num_held(self) -> int:
        return len(self._held)

    def held_ids(self) -> list[str]:
        return list(self._held)

    def held_requests(self) -> list[Any]:
        return list(self._held.values())

    def hold(self, req: Any) -> bool:
        """Start reading the request's blocks past its local hit; True when it must wait for them."""
        if not self.kv.enable_caching or not req.block_hashes:
            return False
        max_blocks = self._hit_blocks(req)
        if max_blocks <= 0:
            return False
        hashes = req.block_hashes[:max_blocks]
        if self.hybrid:
            return self._hold_hybrid(req, hashes)
        # The same lookup the scheduler will make (device, then host), without touching stats or blocks.
        local = len(self.kv.managers[0].find_longest_cache_hit(hashes, max_blocks))
        if not self.tier.request_arrived(req.request_id, hashes[local:]):
            return False
        self._held[req.request_id] = req
        return True

    def _hit_blocks(self, req: Any) -> int:
        """The most blocks the scheduler's lookup takes of the request (its last token is always computed, and
        a request may limit its hit: `max_hit_blocks`)."""
        n = (len(req.all_token_ids) - 1) // self.block_size
        return n if req.max_hit_blocks is None else min(n, req.max_hit_blocks)

    def read_plan(self, hashes: Sequence[bytes]) -> ReadPlan:
        """What the local tiers hold of the prompt's blocks in every group, and the hit they give: the
        same rule as the scheduler's lookup (`hit_point` agrees with `KVCacheManager._hybrid_hit`),
        without touching stats or blocks."""
        n = len(hashes)
        keys = [[group_key(h, g) for h in hashes] for g in range(self.kv.num_groups)]
        local = [[m.lookup(k) is not None for k in keys[g]] if m.caches_prefix else [False] * n
                 for g, m in enumerate(self.kv.managers)]
        return ReadPlan(self.rules, local, hit_point(self.rules, local, n), n, keys, self.kv.page_type)

    def _hold_hybrid(self, req: Any, hashes: Sequence[bytes], deadline: float | None = None) -> bool:
        plan = self.read_plan(hashes)
        if plan.local_point >= plan.limit:
            return False  # the local tiers already give the longest hit allowed
        candidates = plan.candidates()
        if not candidates:
            return False
        # Keys an earlier request's read is reading are left to it; but that read lands only what its own hit
        # needs, which may not be what this one's needs: once those reads are in, this request reads what is
        # still missing itself (once, within its first deadline; see `pump`).
        borrows = deadline is None and self.tier.fetching_any(candidates)
        if not self.tier.request_arrived_with(req.request_id, candidates, lambda owned: plan.job(candidates, owned),
                                              cost=(plan.needed_from_store(), plan.limit - plan.local_point),
                                              deadline=deadline):
            return False
        self._held[req.request_id] = req
        if borrows:
            self._again[req.request_id] = self.tier.clock() + self.tier.deadline_s
        return True

    def _land_hybrid(self, pairs: list[tuple[bytes, Any]]) -> int:
        """Write landed (key, (page type, group, payload)) pairs into host blocks of their page type."""
        by_type: dict[int, tuple[list[Any], list[bytes]]] = {}
        for key, (t, group, payload) in pairs:
            hb = self.kv.host.pools[t].shelter(key, group, announced=False)  # type: ignore[union-attr]
            if hb is None:
                continue  # already there (landed by another read, or sheltered meanwhile), or no room
            blocks, data = by_type.setdefault(t, ([], []))
            blocks.append(hb)
            data.append(payload)
        landed = 0
        for t, (blocks, data) in by_type.items():
            pool = self.kv.host.pools[t]  # type: ignore[union-attr]
            pages = self.pages[t]
            if self.tier.copied(lambda p=pages, b=blocks, d=data: p.scatter([x.block_id for x in b], d),
                                pool.unshelter, blocks):
                pool.free_blocks(blocks)
                landed += len(blocks)
        return landed

    def times(self, scheduled: Sequence[Any]) -> bool:
        """Whether a step of these `ScheduledRequest`s tells what recomputing a block costs (`prompt_step`)."""
        return prompt_step(scheduled, self.block_size)

    def step_computed(self, seconds: float, scheduled: Sequence[Any]) -> None:
        """A step that `times` approved took `seconds` of compute (its swaps left out) for the `scheduled`
        requests: what recomputing a block costs, which a store read must beat for a request to wait on it
        (`StoreTier.observe_compute`)."""
        self.tier.observe_compute(seconds, sum(s.num_new_tokens for s in scheduled) / self.block_size)

    def pump(self) -> list[Any]:
        """Land completed reads in host blocks; the held requests that may be scheduled now, in order."""
        if self.hybrid:
            self.tier.land_with(self._land_hybrid, lambda tp: self.tier.fits(tp[2], self.pages[tp[0]].nbytes))
        else:
            self.tier.land(lambda h: self.pool.shelter(h, announced=False), self.pool.free_blocks, self.caches,
                           self.pool.unshelter, budget=self.pool.get_num_free_blocks())
        ready = []
        for rid, req in list(self._held.items()):
            if not self.tier.ready(rid):
                continue
            deadline = self._again.pop(rid, None)
            if deadline is not None and self.tier.clock() < deadline and self._hold_hybrid(
                    req, req.block_hashes[:self._hit_blocks(req)], deadline):
                continue  # its own read of what the others' did not land
            ready.append(rid)
        return [self._held.pop(rid) for rid in ready]

    def after_swaps(self, plan: SwapPlan) -> None:
        """Write through to the store the host blocks this step's copies filled."""
        if not self.hybrid:
            if plan.swap_out:
                self._write_through(self.pool, [h for _, h in plan.swap_out], lambda ids: gather(self.caches, ids))
            return
        # Every group's sheltered blocks, under their host keys (group_key), per page type.
        by_type: dict[int, list[int]] = {}
        for _, h in plan.swap_out:
            by_type.setdefault(0, []).append(h)
        for t, _, h in plan.typed_out:
            by_type.setdefault(t, []).append(h)
        pools = self.kv.host.pools  # type: ignore[union-attr]
        for t, ids in by_type.items():
            self._write_through(pools[t], ids, self.pages[t].gather)

    def _write_through(self, pool: Any, ids: list[int], gather_ids: Callable[[list[int]], Sequence[Any]]) -> None:
        """Queue the host blocks `ids` of `pool` under their keys; with KV events on, each carries the
        `BlockStored` (medium STORAGE) published once the store has it."""
        blocks = pool.blocks
        ids = [h for h in ids if blocks[h].block_hash is not None]
        if not ids:
            return
        keys = [blocks[h].block_hash for h in ids]
        tags = ([block_stored(blocks[h], k, self.block_size, MEDIUM_STORE) for h, k in zip(ids, keys, strict=True)]
                if self.kv_events else None)
        self.tier.write(list(zip(keys, gather_ids(ids), strict=True)), tags)

    def take_events(self) -> list[Any]:
        """`BlockStored` events (medium STORAGE) of the blocks the store took since the last call."""
        return self.tier.worker.take_written()

    def has_events(self) -> bool:
        return self.tier.worker.has_written()

    def drop(self, request_id: str) -> Any | None:
        """Forget a held request (aborted before it was scheduled)."""
        self.tier.forget(request_id)
        self._again.pop(request_id, None)
        return self._held.pop(request_id, None)

    def close(self) -> None:
        """Write what is queued (a few seconds at most), then stop the worker."""
        atexit.unregister(self._close_at_exit)
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
        yield counter("requests_not_held_recompute",
                      "Requests not held for a store read expected to be slower than computing the blocks.",
                      tier.reads_skipped_recompute)
        yield gauge("recompute_seconds_per_block", "Measured seconds to compute one block of prompt (0: not yet).",
                    tier.recompute_s_per_block or 0.0)
        yield gauge("requests_waiting", "Requests waiting for their store reads.", self.store.num_held())
        yield gauge("available", "1 while the store answers, 0 while backing off.", float(tier.worker.store.available))
        yield gauge("slow", "1 while store reads miss the deadline and requests do not wait for them.",
                    float(tier.slow))
