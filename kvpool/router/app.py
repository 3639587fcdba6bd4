"""`kvpool router`: an OpenAI-compatible front door for N `kvpool serve` replicas (or any server speaking
the same API and vLLM's KV events).

Per request: parse the body as the replicas would (`kvpool.server.protocol`), tokenize it with the same
tokenizer and chat template, hash its blocks with the replicas' `BlockHasher` settings (block size, hash
algorithm, seed, cache salt), look the hashes up in the index fed by every replica's KV events, choose a
replica (`kvpool.router.policy`), and proxy the request there, streaming included. A replica that cannot
be reached, or answers 500/502/503/504, before anything was sent to the client has the request sent to the
next best replica (a run of 500/502/504 answers, or a connection error, marks it down). Once bytes have
reached the client, a stream whose replica fails (its connection breaks, or it is marked down) is finished
by another replica when that one would answer with the same text (greedy or seeded, one choice:
`kvpool.router.resume`), and otherwise ends with an error event. A stream counts as started at its first event that
carries something (text, a tool call, a finish reason, an error): a chat stream's first event, the role
alone, is sent by the replica as soon as the request is queued, and is held back until then. A request
whose replica is marked down (by the health checks, say it froze) while nothing has reached the client yet
is cancelled there and sent to the next replica.

A health thread polls each replica's /health and /metrics (running, waiting, KV usage) twice a second;
a replica that fails is left out until it answers again. On its way back, a replica with events has its
index rebuilt from its replay socket (it may have restarted, its caches empty). A client that disconnects
before its answer is complete has its request to the replica dropped (the replica then aborts it). Pins
and the prefix-cache reset go to every replica (`kvpool.router.admin`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio
import httpx
import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError

from kvpool.core import hit_rules
from kvpool.core.hashing import BlockHasher
from kvpool.core.hit_rules import GroupRule
from kvpool.core.request import CacheRequest
from kvpool.engine.chat_template import ChatOptions, load_chat_template, render_chat
from kvpool.router.admin import WATCH_POLL_S, add_admin_routes, forward_headers, while_up
from kvpool.router.index import DEFAULT_MAX_STORE_BLOCKS, PrefixIndex, RoutedIndex
from kvpool.router.policy import ReplicaLoad, choose
from kvpool.router.resume import Diverged, StreamText, resumable
from kvpool.router.subscriber import EventSubscriber
from kvpool.server.cors import add_cors
from kvpool.server.errors import (
    APIError,
    add_error_handlers,
    cancel_and_wait,
    check_api_key,
    read_raw,
)
from kvpool.server.json_body import BodyError, parse_json_object
from kvpool.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, chat_messages

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ReplicaSpec:
    """One `--replica` value: `URL[,events=ZMQ_ENDPOINT][,replay=ZMQ_ENDPOINT][,topic=TOPIC]`."""

    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> ReplicaSpec:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts or not parts[0].startswith(("http://", "https://")):
            raise ValueError(f"replica: {text!r} must start with an http:// or https:// URL")
        try:
            url = urlsplit(parts[0])
            url.port  # noqa: B018 (raises for a port out of range or not a number)
        except ValueError as e:
            raise ValueError(f"replica: {parts[0]!r} is not a valid URL ({e})") from None
        if not url.hostname:
            raise ValueError(f"replica: {parts[0]!r} names no host")
        spec = cls(parts[0].rstrip("/"))
        seen: set[str] = set()
        for p in parts[1:]:
            key, eq, value = p.partition("=")
            if not eq or key not in ("events", "replay", "topic"):
                raise ValueError(f"replica: unknown option {p!r} in {text!r} (events=, replay=, topic=)")
            if key in seen:
                raise ValueError(f"replica: {key}= given twice in {text!r}")
            seen.add(key)
            if key in ("events", "replay") and "://" not in value:
                raise ValueError(f"replica: {key}={value!r} is not a ZeroMQ endpoint such as tcp://host:port")
            setattr(spec, key, value)
        if spec.events is None and seen & {"replay", "topic"}:
            # (they belong to the event stream: without one they would be ignored, silently)
            raise ValueError(f"replica: {', '.join(sorted(seen))}= without events= in {text!r}: the replay socket and "
                             f"the topic are those of the replica's KV event stream")
        return spec


@dataclass
class Replica:
    spec: ReplicaSpec
    healthy: bool = True
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    routed: int = 0
    failures: int = 0
    missed_checks: int = 0  # health checks in a row that timed out
    error_run: int = 0  # 500/502/504 answers in a row
    # Times marked down: an attempt in flight that has sent the client nothing watches it, and is cancelled
    # and retried elsewhere when it changes (a frozen replica never answers, and never drops the connection).
    downs: int = 0
    subscriber: EventSubscriber | None = None
    instance: str | None = None  # the id of its KV-event stream, as its /health last told it
    # What a prefix hit needs from each of its layer groups, as its /health last told it (a kvpool replica;
    # None: unknown, a hash held by any group counts; see kvpool.core.hit_rules).
    kv_groups: tuple[GroupRule, ...] | None = None
    bad_kv_groups: str | None = None  # the last header it sent that could not be read (logged once)

    @property
    def name(self) -> str:
        return self.spec.url


@dataclass(frozen=True)
class RouteKey:
    """What a request is routed by: `hashes`, the block hashes a replica gives its prompt (matched against
    the replicas' KV events), and for a chat with images `sticky`: its text's hashes salted with a digest of
    its images, matched against and remembered in what the router sent each replica. A replica hashes an
    image by its processed pixels, which the router (with a tokenizer, not the model's image processor)
    cannot reproduce; by these a conversation's later turns, which carry the same images, still find the
    replica that cached its earlier ones, and a conversation with the same words and another image does not."""

    hashes: list[bytes]
    sticky: list[bytes] | None = None
    # The most blocks a replica can serve of the prompt: its last token is always computed, so a prompt of
    # exactly k blocks hits k - 1 at most (a hybrid replica's hit is then the longest servable within those,
    # which may be far shorter than within k). None: every full block.
    servable: int | None = None

    def hit_hashes(self) -> tuple[list[bytes], list[bytes] | None]:
        """`hashes` and `sticky` cut to what a replica can serve: what the index is matched with."""
        n = self.servable
        return (self.hashes[:n], None if self.sticky is None else self.sticky[:n]) if n is not None else \
            (self.hashes, self.sticky)


def _has_image(m: ChatMessage) -> bool:
    return isinstance(m.content, list) and any(p.image_url is not None for p in m.content)


def image_digest(messages: list[ChatMessage]) -> str | None:
    """A digest of a chat's images in order (their URLs: a data URL holds the bytes), None without one."""
    h = xxhash.xxh3_128()
    n = 0
    for m in messages:
        for part in m.content if isinstance(m.content, list) else ():
            if part.image_url is not None:
                url = part.image_url.url.encode()
                h.update(len(url).to_bytes(8, "little") + url)
                n += 1
    return h.hexdigest() if n else None


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.decisions = Counter("kvpool_router:routing_decisions",
                                 "Routing decisions, by replica and reason (a retried request is routed again).",
                                 ["replica", "reason"], registry=r)
        self.prompt_blocks = Counter("kvpool_router:prompt_blocks", "Full prompt blocks of routed requests.",
                                     registry=r)
        self.matched_blocks = Counter("kvpool_router:matched_blocks",
                                      "Of those, blocks cached on the chosen replica (by the index).", registry=r)
        self.matched_fraction = Histogram("kvpool_router:matched_prefix_fraction",
                                          "Cached fraction of each prompt's blocks on the chosen replica.",
                                          buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0), registry=r)
        self.retries = Counter("kvpool_router:retries", "Requests resent to another replica before streaming.",
                               ["replica"], registry=r)
        self.taken_up = Counter("kvpool_router:streams_taken_up",
                                "Streams another replica finished after this one failed mid-stream.", ["replica"],
                                registry=r)
        self.failed = Counter("kvpool_router:requests_failed", "Requests no replica could take (HTTP 503).",
                              registry=r)
        self.healthy = Gauge("kvpool_router:replica_healthy", "1 if the replica answers its health check.",
                             ["replica"], registry=r)
        self.in_flight = Gauge("kvpool_router:replica_in_flight", "Requests in flight through the router.",
                               ["replica"], registry=r)
        self.waiting = Gauge("kvpool_router:replica_waiting", "The replica's waiting requests (its /metrics).",
                             ["replica"], registry=r)
        self.running = Gauge("kvpool_router:replica_running", "The replica's running requests (its /metrics).",
                             ["replica"], registry=r)
        self.kv_usage = Gauge("kvpool_router:replica_kv_usage", "The replica's device KV usage (0-1).",
                              ["replica"], registry=r)
        self.indexed = Gauge("kvpool_router:replica_indexed_blocks", "Block hashes indexed for the replica.",
                             ["replica"], registry=r)
        self.event_batches = Counter("kvpool_router:event_batches", "KV event batches received.", ["replica"],
                                     registry=r)
        self.hash_mismatch = Counter("kvpool_router:hash_mismatches",
                                     "Stored blocks whose hash the router cannot reproduce (config differs).",
                                     ["replica"], registry=r)
        self.events_alive = Gauge("kvpool_router:replica_events_alive",
                                  "1 while the replica's KV event subscriber runs (0: routed by what was sent).",
                                  ["replica"], registry=r)
        self.event_errors = Counter("kvpool_router:event_batch_errors",
                                    "KV event batches the router could not use (each forgets the replica's index).",
                                    ["replica"], registry=r)


class Router:
    """Routing state, shared by the HTTP handlers (event loop), the health thread and the subscribers."""

    def __init__(self, replicas: list[ReplicaSpec], *, tokenizer: Any = None, block_size: int = 16,
                 hash_algo: str = "sha256", hash_seed: str | None = None, beta: float = 1.0, gamma: float = 0.2,
                 routed_ttl_s: float = 300.0, pending_ttl_s: float = 3.0, recent_half_life_s: float = 2.0,
                 health_interval_s: float = 0.5, health_timeout_s: float = 1.0, policy: str = "cache",
                 max_store_blocks: int = DEFAULT_MAX_STORE_BLOCKS) -> None:
        if not replicas:
            raise ValueError("replica: give at least one --replica URL")
        if policy not in ("cache", "round-robin"):
            raise ValueError(f"policy: {policy!r} is not one of cache, round-robin")
        self.replicas = {s.url: Replica(s) for s in replicas}
        if len(self.replicas) != len(replicas):
            raise ValueError("replica: the same URL was given twice")
        self.tokenizer = tokenizer
        self.hasher = BlockHasher(block_size, hash_algo, hash_seed)
        self.block_size = block_size
        self.beta, self.gamma = beta, gamma
        self.policy = policy
        self.index = PrefixIndex(max_store_blocks)
        # Replicas without events: what we sent them, for a long while. With events: the last few seconds
        # only, until the replica's own BlockStored arrives.
        self.routed = RoutedIndex(routed_ttl_s)
        self.pending = RoutedIndex(pending_ttl_s)
        self.recent_half_life_s = recent_half_life_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.down_after_missed_checks = 3
        self.down_after_errors = 3  # 500/502/504 answers in a row
        self.metrics = RouterMetrics()
        for n in self.replicas:  # export zeros from the start, so a dashboard sees every replica
            for c in (self.metrics.hash_mismatch, self.metrics.event_batches, self.metrics.retries,
                      self.metrics.taken_up, self.metrics.event_errors):
                c.labels(n)
            self.metrics.healthy.labels(n).set(1)
        self._lock = threading.Lock()
        self._rr = 0
        self._stop = threading.Event()
        self._health_thread = threading.Thread(target=self._health_loop, name="kvpool-router-health", daemon=True)
        self._checked_hash: set[str] = set()
        # LoRA adapters by name -> the digest of their files, as the replicas' BlockStored events name them
        # (the last one seen wins: a name the replicas agree on, or one being rolled out).
        self.lora_digests: dict[str, str] = {}
        self._tok_lock = threading.Lock()  # HF fast tokenizers refuse concurrent use ("Already borrowed")

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the subscribers and the health thread; a ValueError names an events endpoint ZeroMQ refuses."""
        try:
            for rep in self.replicas.values():
                if rep.spec.events:
                    rep.subscriber = EventSubscriber(rep.name, rep.spec.events, self.index,
                                                     replay_endpoint=rep.spec.replay, topic=rep.spec.topic,
                                                     on_batch=self._on_batch, on_error=self._on_event_error).start()
        except ValueError:
            self.stop()
            raise
        self._health_thread.start()

    def stop(self) -> None:
        self._stop.set()
        for rep in self.replicas.values():
            if rep.subscriber is not None:
                rep.subscriber.stop()
        if self._health_thread.is_alive():
            self._health_thread.join(5)

    # -- events -------------------------------------------------------------------------------------

    def _on_event_error(self, replica: str) -> None:
        self.metrics.event_errors.labels(replica).inc()

    def _on_batch(self, replica: str, events: list[dict[str, Any]]) -> None:
        self.metrics.event_batches.labels(replica).inc()
        for e in events:
            name = e.get("lora_name")
            keys = e.get("extra_keys")
            if e.get("type") == "BlockStored" and isinstance(name, str) and isinstance(keys, list) and keys:
                first = keys[0]  # (the first block's keys: the name, then the digest)
                if (isinstance(first, list | tuple) and len(first) >= 2 and first[0] == name
                        and isinstance(first[1], str)):
                    self.lora_digests[name] = first[1]
        if replica in self._checked_hash:
            return
        # Once per replica: recompute the hash of a first block from its tokens. A different block size,
        # hash algorithm or seed on the replica would make every lookup miss silently; say so instead.
        for e in events:
            if (e.get("type") == "BlockStored" and e.get("parent_block_hash") is None and not e.get("extra_keys")
                    and e.get("lora_name") is None and isinstance(e.get("token_ids"), list)
                    and len(e["token_ids"]) >= self.block_size and isinstance(e.get("block_hashes"), list)
                    and e["block_hashes"] and e.get("medium") == "GPU"):
                self._checked_hash.add(replica)
                tokens = list(e["token_ids"][: self.block_size])
                mine = CacheRequest("check", tokens, hasher=self.hasher).block_hashes[0]
                if e.get("block_size") != self.block_size or mine != e["block_hashes"][0]:
                    self.metrics.hash_mismatch.labels(replica).inc()
                    log.error("router: replica %s hashes blocks differently (its block size %s, ours %d): give the "
                              "router the replicas' --block-size/--hash-algo/--hash-seed", replica,
                              e.get("block_size"), self.block_size)
                return

    # -- health -------------------------------------------------------------------------------------

    def _health_loop(self) -> None:
        with httpx.Client(timeout=self.health_timeout_s) as client:
            while not self._stop.is_set():
                for rep in list(self.replicas.values()):
                    try:
                        self._check(client, rep)
                    except Exception:  # one replica's odd answer must not end the checks of all of them
                        log.exception("router: health check of replica %s failed; counted as missed", rep.name)
                        if self._missed(rep):
                            with self._lock:
                                if rep.healthy:
                                    rep.healthy = False
                                    rep.downs += 1
                        self.metrics.healthy.labels(rep.name).set(1 if rep.healthy else 0)
                self._stop.wait(self.health_interval_s)

    def _rules(self, names: list[str]) -> dict[str, tuple[GroupRule, ...] | None]:
        return {n: self.replicas[n].kv_groups for n in names}

    @staticmethod
    def _kv_groups(rep: Replica, header: str | None) -> tuple[GroupRule, ...] | None:
        """The replica's hit rules from its /health header (None: it sends none, or one this router cannot
        read, which is logged once per distinct header)."""
        if header is None:
            return None
        try:
            return hit_rules.parse(header)
        except ValueError as e:
            if header != rep.bad_kv_groups:
                log.warning("router: replica %s: %s; a hash any group holds counts as cached", rep.name, e)
                rep.bad_kv_groups = header
            return None

    def _check(self, client: httpx.Client, rep: Replica) -> None:
        polled_at = time.monotonic()  # before the request: a completion during it makes the poll stale
        instance = None
        try:
            health = client.get(f"{rep.name}/health")
            ok = health.status_code == 200
            instance = health.headers.get("kvpool-instance") if ok else None
            if ok:
                rep.kv_groups = self._kv_groups(rep, health.headers.get(hit_rules.HEADER))
            text = client.get(f"{rep.name}/metrics").text if ok else ""
            answered = True
        except httpx.TimeoutException:
            # A replica busy with a long prompt can answer late: only a run of missed checks marks it
            # down (one miss made replicas on a loaded machine flap, and routing around a replica that
            # holds a conversation's blocks costs that conversation its hits).
            if not self._missed(rep):
                return
            ok, text, answered = False, "", False
        except httpx.HTTPError:  # refused, reset: the process is gone
            ok, text, answered = False, "", True
        vals = _read_metrics(text) if ok else {}
        if answered:  # (only now: an answer the router cannot read counts as a missed check, see _health_loop)
            rep.missed_checks = 0
        with self._lock:
            back = ok and not rep.healthy
            # A new stream id from a replica never seen down: it restarted between two checks, and its
            # new stream's first batches (which would have said so) may be lost.
            restarted = instance is not None and rep.instance is not None and instance != rep.instance
            # The same stream id as before it went down: the same process (frozen, or failing requests for a
            # while), its caches intact; its subscriber's gap repair brings the index up to date.
            same_process = instance is not None and instance == rep.instance
            if instance is not None:
                rep.instance = instance
            if restarted and not back:
                log.warning("router: replica %s restarted (new event stream %s)", rep.name, instance)
                back = True
            if ok != rep.healthy:
                log.warning("router: replica %s is %s", rep.name, "back" if ok else "down")
                if not ok:
                    rep.downs += 1
            rep.healthy = ok
            if ok:
                rep.load.running = int(vals.get("num_requests_running", 0))
                rep.load.waiting = int(vals.get("num_requests_waiting", 0))
                rep.load.kv_usage = vals.get("kv_cache_usage_perc", 0.0)
                rep.load.polled_at = polled_at
        if back and not same_process:
            # It may have restarted, its caches empty (its new event stream would say so, but only with its
            # first event): what was routed there is forgotten (chats with pictures, and everything for a
            # replica without events), and its index rebuilt from its replay. Rebuilding a live replica's
            # index would forget what its replay buffer no longer reaches, still cached there. A new process
            # may also hash blocks otherwise (another --hash-seed): its first block is checked again.
            self._checked_hash.discard(rep.name)
            self.routed.clear(rep.name)
            if rep.subscriber is not None:
                self.pending.clear(rep.name)
                rep.subscriber.resync()
        m = self.metrics
        m.healthy.labels(rep.name).set(1 if ok else 0)
        if rep.subscriber is not None:
            m.events_alive.labels(rep.name).set(1 if rep.subscriber.alive else 0)
        m.running.labels(rep.name).set(rep.load.running)
        m.waiting.labels(rep.name).set(rep.load.waiting)
        m.kv_usage.labels(rep.name).set(rep.load.kv_usage)
        m.indexed.labels(rep.name).set(self.index.num_blocks(rep.name))

    def _missed(self, rep: Replica) -> bool:
        """Count a missed health check; True once enough in a row say the replica is down."""
        with self._lock:
            rep.missed_checks += 1
            return rep.missed_checks >= self.down_after_missed_checks

    def mark_down(self, name: str) -> None:
        with self._lock:
            rep = self.replicas[name]
            if rep.healthy:
                log.warning("router: replica %s failed a request; routing around it", name)
            rep.healthy = False
            rep.failures += 1
            rep.downs += 1
        self.metrics.healthy.labels(name).set(0)

    def answered(self, name: str, status: int) -> None:
        """A replica's answer to a request: 500/502/504 count as failures (a run of them marks it down,
        and the health checks bring it back); anything below 500 ends the run."""
        with self._lock:
            rep = self.replicas[name]
            if status in (500, 502, 504):
                rep.error_run += 1
                if rep.error_run < self.down_after_errors:
                    rep.failures += 1
                    return
                rep.error_run = 0  # (and `mark_down` counts this failure)
            else:
                if status < 500:
                    rep.error_run = 0
                return
        self.mark_down(name)

    # -- routing ------------------------------------------------------------------------------------

    def block_hashes(self, tokens: list[int] | None, cache_salt: str | None, model: Any = None) -> list[bytes]:
        """The hashes a replica gives the request's blocks. A request for a LoRA adapter (its `model`) is
        hashed under the adapter's name and file digest, as the replicas hash it, once a replica's events
        have named that digest (before that, as the base model's: the router cannot tell a new adapter's
        name from the base model's)."""
        if not tokens:
            return []
        lora = self.lora_digests.get(model) if isinstance(model, str) else None
        return list(CacheRequest("route", tokens, hasher=self.hasher, cache_salt=cache_salt,
                                 lora_id=model if lora is not None else None, lora_content=lora).block_hashes)

    def pick(self, key: RouteKey, exclude: set[str]) -> tuple[str, int] | None:
        """The replica for a request with these block hashes (and its matched blocks), counting it in
        flight there; None when no healthy replica is left."""
        blocks = max(len(key.hashes), len(key.sticky or ()))  # the prompt's full blocks
        hashes, sticky = key.hit_hashes()
        now = time.monotonic()
        with self._lock:
            cands = [n for n, r in self.replicas.items() if r.healthy and n not in exclude]
            if not cands:
                return None
            self._rr += 1
            for r in self.replicas.values():
                r.load.decay(now, self.recent_half_life_s)
            if self.policy == "round-robin":
                name = cands[self._rr % len(cands)]
                matched = self.index.match(hashes, [name], self._rules([name]))[name][0] if hashes else 0
                reason = "round-robin"
            else:
                matched_all = self.index.match(hashes, cands, self._rules(cands)) if hashes else {}
                for n in cands:
                    rep = self.replicas[n]
                    approx = (self.routed.match(sticky, n, now) if sticky is not None
                              else self._approx(rep).match(hashes, n, now))
                    got = matched_all.get(n, (0, 0.0))
                    if approx > got[0]:  # routed there recently: its events have not arrived yet
                        matched_all[n] = (approx, got[1] + (approx - got[0]))
                c = choose(cands, matched_all, {n: self.replicas[n].load for n in cands}, blocks,
                           beta=self.beta, gamma=self.gamma, tie_break=self._rr)
                name, matched, reason = c.replica, c.matched_blocks, c.reason
            rep = self.replicas[name]
            rep.load.in_flight += 1
            rep.load.recent += 1
            rep.routed += 1
        if key.sticky is not None:
            self.routed.record(name, key.sticky, now)
        else:
            self._approx(rep).record(name, hashes, now)
        m = self.metrics
        m.decisions.labels(name, reason).inc()
        m.in_flight.labels(name).set(rep.load.in_flight)
        if blocks:
            m.prompt_blocks.inc(blocks)
            m.matched_blocks.inc(matched)
            m.matched_fraction.observe(matched / blocks)
        return name, matched

    def _approx(self, rep: Replica) -> RoutedIndex:
        """Where a replica's routed requests are remembered: for a few seconds while its events flow, for a
        long while when it has none (or its subscriber died: its index no longer changes)."""
        return self.pending if rep.subscriber is not None and rep.subscriber.alive else self.routed

    def done(self, name: str) -> None:
        with self._lock:
            rep = self.replicas[name]
            rep.load.in_flight = max(0, rep.load.in_flight - 1)
            rep.load.done_at = time.monotonic()
        self.metrics.in_flight.labels(name).set(rep.load.in_flight)

    # -- tokenization -------------------------------------------------------------------------------

    def route_key(self, path: str, body: dict[str, Any]) -> RouteKey:
        """What the request is routed by (tokenized as a replica would, hashed as a replica hashes)."""
        with self._tok_lock:
            tokens, salt, images, before_images = self._tokens_of(path, body)
        keep = body.get("truncate_prompt_tokens")
        if type(keep) is int and keep > 0 and tokens and images is None:
            tokens = tokens[-keep:]  # (what the replica runs; -1 depends on its context: left as sent)
        model = body.get("model")
        try:
            if images is None:
                return RouteKey(self.block_hashes(tokens, salt, model),
                                servable=(len(tokens) - 1) // self.block_size if tokens else None)
            # Past the first picture the replicas' tokens (and hashes) are not these: matched against their
            # events, they would credit a replica holding the same words without the picture. So the events
            # are matched on the blocks before it (a chain: the prompt's own first hashes).
            assert tokens is not None
            return RouteKey(self.block_hashes(tokens[:before_images], salt, model),
                            self.block_hashes(tokens, f"{salt or ''}|images:{images}", model))
        except ValueError:  # token ids no tokenizer makes (a replica answers with the 400 that says why)
            return RouteKey([])

    def _tokens_of(self, path: str, body: dict[str, Any]
                   ) -> tuple[list[int] | None, str | None, str | None, int]:
        """The prompt's token ids as a replica would compute them (a chat's images left out), the cache
        salt, a digest of the chat's images in order (None without images), and how many leading tokens a
        replica has too (all but those from the first message with a picture on); (None, None, None, 0)
        when the router cannot tell (no tokenizer for a text prompt, or a body the replica will reject)."""
        try:
            if path.endswith("/chat/completions"):
                req = ChatCompletionRequest.model_validate(body)
                images = image_digest(req.messages)
                if req.chat_template is not None:
                    # (a request's own template is Jinja from a client: a replica that trusts such templates
                    # renders it; the router does not, and routes the chat by load, images or not)
                    return None, req.cache_salt, None, 0
                if self.tokenizer is None:
                    return None, req.cache_salt, images, 0
                options = req.chat_options()
                ids = self._chat_ids(chat_messages(req.messages), options)
                if images is None:
                    return ids, req.cache_salt, None, len(ids)
                first = next(i for i, m in enumerate(req.messages) if _has_image(m))
                before = self._chat_ids(chat_messages(req.messages[:first]), ChatOptions(
                    add_generation_prompt=False, template_kwargs=options.template_kwargs)) if first else []
                return ids, req.cache_salt, images, len(before) if ids[:len(before)] == before else 0
            creq = CompletionRequest.model_validate(body)
            prompt = creq.prompts()[0]  # (a batch goes to one replica: routed by its first prompt)
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    return None, creq.cache_salt, None, 0
                ids = list(self.tokenizer.encode(prompt, add_special_tokens=creq.add_special_tokens))
                return ids, creq.cache_salt, None, len(ids)
            return list(prompt), creq.cache_salt, None, len(prompt)
        except (ValidationError, ValueError, TypeError, KeyError):
            return None, None, None, 0
        except Exception as e:  # a template that refuses the conversation: the replica will say why
            log.debug("router: could not tokenize (%s)", e)
            return None, None, None, 0

    def _chat_ids(self, messages: list[dict[str, str]], options: ChatOptions) -> list[int]:
        return render_chat(self.tokenizer, messages, options)  # (the replicas' renderer: the same tokens)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {n: {"healthy": r.healthy, "routed": r.routed, "in_flight": r.load.in_flight,
                        "running": r.load.running, "waiting": r.load.waiting, "kv_usage": r.load.kv_usage,
                        "indexed_blocks": self.index.num_blocks(n), "failures": r.failures,
                        "events": r.subscriber is not None,
                        "events_alive": r.subscriber is not None and r.subscriber.alive,
                        "event_batch_errors": 0 if r.subscriber is None else r.subscriber.decode_errors}
                    for n, r in self.replicas.items()}


def _read_metrics(text: str) -> dict[str, float]:
    """The few gauges the policy reads, from a kvpool (`kvpool:x`) or vLLM (`vllm:x`) /metrics page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        short = name.split(":", 1)[-1]
        if short in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            with contextlib.suppress(ValueError):
                value = float(rest.rsplit(" ", 1)[-1])
                if math.isfinite(value) and value >= 0:  # (NaN or Inf: not a load the policy can weigh)
                    out[short] = out.get(short, 0.0) + value
    return out


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return APIError(status, message, param).response()


class _KeyRequired:
    """`--api-key`: every route but /health and /metrics (probes, scrapers) needs the key, checked before
    the body is read, tokenized or routed. Plain ASGI, not Starlette's BaseHTTPMiddleware, under which a
    handler no longer sees its client leave (and so cannot drop the request on the replica)."""

    OPEN = frozenset(("/health", "/metrics"))

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            try:
                check_api_key(Request(scope), self.api_key)
            except APIError as e:
                await e.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(router: Router, *, max_body_bytes: int = 4 << 20, max_attempts: int = 3,
               request_timeout_s: float | None = None, api_key: str | None = None,
               allowed_origins: Sequence[str] | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await app.state.client.aclose()  # the connections to the replicas, closed with the server (lifespan on)

    app = FastAPI(title="kvpool router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    add_error_handlers(app)  # unknown routes, wrong methods and anything unexpected: OpenAI error bodies
    if api_key is not None:
        app.add_middleware(_KeyRequired, api_key=api_key)
    add_cors(app, allowed_origins)  # (after the key's middleware: outside it, so preflights pass)
    # No read timeout by default: a non-streaming answer arrives whole when it is done, which for a long
    # generation on a slow machine can take many minutes; timing it out would mark a healthy replica down
    # and run the request again elsewhere. A dead replica drops the connection (or fails its health
    # checks), and a client that gives up has its request dropped.
    client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=2.0),
                               limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
    app.state.client = client

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' checks)
    async def health(request: Request) -> Response:
        if not any(r.healthy for r in router.replicas.values()):
            return _error(503, "no replica is healthy")
        try:  # (open to probes; the replicas' URLs and loads only with the key, as /router/state)
            check_api_key(request, api_key)
        except APIError:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "replicas": router.snapshot()})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/state")
    async def state() -> JSONResponse:
        return JSONResponse(router.snapshot())

    async def forward_get(path: str, request: Request) -> Response:
        """The first healthy replica's answer; the next one's when a replica fails to answer (it drops the
        connection, is marked down while the request waits, or answers with a fault of its own)."""
        fault: httpx.Response | None = None
        for name, rep in list(router.replicas.items()):
            if not rep.healthy:
                continue
            try:
                answered, r = await while_up(client.get(f"{name}{path}", headers=forward_headers(request)),
                                             router, name, request)
            except httpx.HTTPError:
                router.mark_down(name)
                continue
            if not answered:  # marked down while it waited (or the client left: then nobody reads this)
                continue
            assert r is not None
            if r.status_code >= 500:
                fault = fault or r
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        if fault is not None:
            return Response(fault.content, status_code=fault.status_code, media_type=fault.headers.get("content-type"))
        router.metrics.failed.inc()
        return _error(503, "no replica is healthy")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await forward_get("/v1/models", request)

    add_admin_routes(app, router, client, max_body_bytes)  # pins and the cache reset, on every replica

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy("/v1/chat/completions", request)

    async def proxy(path: str, request: Request) -> Response:
        raw = await read_raw(request, max_body_bytes)
        try:
            body = parse_json_object(raw, request.headers.get("content-type"))
        except BodyError as e:
            return _error(400, str(e))
        key = await asyncio.to_thread(router.route_key, path, body)
        stream = bool(body.get("stream"))
        tried: set[str] = set()
        last_error: tuple[int, bytes, str | None] | None = None  # the last retried answer, for the client
        headers = forward_headers(request)
        left: str | None = None  # the replica the last attempt failed on

        async def attempt() -> Response | _Upstream | None:
            """The next replica's answer: a whole Response, a stream's _Upstream whose first event that
            carries something has come, or None when no replica (of `max_attempts`) could take it."""
            nonlocal last_error, left
            while len(tried) < max_attempts:
                picked = router.pick(key, tried)
                if picked is None:
                    return None
                if left is not None:  # (a retry is counted when another replica takes the request, not before)
                    router.metrics.retries.labels(left).inc()
                name = picked[0]
                tried.add(name)
                epoch = router.replicas[name].downs
                resp: httpx.Response | None = None
                committed = False  # the response is the client's now (and `done` is `_relay`'s to call)
                try:
                    req = client.build_request("POST", f"{name}{path}", content=raw, headers=headers)
                    # A non-streaming answer's headers come when it is complete: watch the client meanwhile,
                    # and the replica's health (a frozen one never answers, nor drops the connection).
                    state, resp = await _watch(client.send(req, stream=True), request, router, name, epoch)
                    if state == "ok" and resp is not None and resp.status_code in _RETRIED:
                        # Overloaded, its engine died, or it failed: try another before giving up.
                        content = b""
                        with contextlib.suppress(httpx.HTTPError, asyncio.TimeoutError):
                            content = await asyncio.wait_for(resp.aread(), 5.0)
                        last_error = (resp.status_code, content, resp.headers.get("content-type"))
                        router.answered(name, resp.status_code)
                        state = "retry"
                    elif state == "ok" and resp is not None and not stream:
                        state, content = await _watch(resp.aread(), request, router, name, epoch)
                        if state == "ok" and content is not None:
                            router.answered(name, resp.status_code)
                            return Response(content, status_code=resp.status_code,
                                            media_type=resp.headers.get("content-type"),
                                            headers={"x-kvpool-replica": name})
                    elif state == "ok" and resp is not None:
                        # Streaming: hold the events back until one carries something (see `_stream_head`),
                        # so a replica that dies or freezes before answering is still retried elsewhere.
                        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
                        chunks = resp.aiter_raw()
                        state, head = await _watch(_stream_head(chunks, sse), request, router, name, epoch)
                        if state == "ok" and head is not None:
                            router.answered(name, resp.status_code)
                            committed = True
                            left = None  # (a later take-up's retries are its own)
                            return _Upstream(name, epoch, resp, chunks, head, sse)
                except httpx.HTTPError:  # refused, reset, or died mid-answer: the client has seen nothing yet
                    router.mark_down(name)
                    state = "retry"
                finally:
                    if not committed:  # (closing the connection mid-answer makes the replica abort the request)
                        if resp is not None:
                            await resp.aclose()
                        router.done(name)
                if state == "gone":  # the client left
                    return Response(status_code=499)
                if state == "down":
                    log.warning("router: replica %s went down with a request in flight; sending it elsewhere", name)
                left = name
            return None

        async def take_up() -> _Upstream | None:
            """Another replica's stream of the same request, to finish a failed one; only a 200 event stream
            will do (a 404 or 429 body has nothing to splice into the client's events)."""
            got = await attempt()
            if isinstance(got, _Upstream) and (got.resp.status_code != 200 or not got.sse):
                await got.close(router)
                return None
            return got if isinstance(got, _Upstream) else None

        got = await attempt()
        if isinstance(got, _Upstream):
            # A stream another replica would repeat is finished there if this one fails mid-way.
            again = take_up if got.sse and resumable(body) else None
            return _RelayResponse(got, router, _relay(got, router, again), status_code=got.resp.status_code,
                                  media_type=got.resp.headers.get("content-type"),
                                  headers={"Cache-Control": "no-cache", "x-kvpool-replica": got.name})
        if got is not None:
            return got
        router.metrics.failed.inc()
        if last_error is not None:  # every replica tried refused or failed: say so, as the last one did
            status, content, ctype = last_error
            return Response(content, status_code=status, media_type=ctype or "application/json",
                            headers={"Retry-After": "1"} if status == 503 else None)
        return _error(503, "no replica could take the request; retry later")

    return app


# Answers retried on another replica when nothing has reached the client yet: overloaded (503), and the
# replica's own failures (500, and a gateway's 502/504 in front of it).
_RETRIED = frozenset((500, 502, 503, 504))
_HEAD_LIMIT = 64 << 10  # bytes of a stream held back at most before it is committed anyway
_STALLED_S = 1.0  # a stream whose replica was marked down, silent this long, has failed


async def _watch(work: Awaitable[T], request: Request, router: Router, name: str, epoch: int
                 ) -> tuple[str, T | None]:
    """("ok", what `work` gives); ("gone", None) once the client has disconnected, or ("down", None) once
    the replica has been marked down since `epoch` (its `downs`): `work` is then cancelled, which for a
    request to a replica closes the connection and makes the replica abort it. `work`'s own exception
    propagates."""
    ok, out = await while_up(work, router, name, request, epoch)
    if ok:
        return "ok", out
    return ("down" if router.replicas[name].downs != epoch else "gone"), None


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")  # an SSE event ends at a blank line


def _events(data: bytes) -> tuple[list[bytes], int]:
    """The complete SSE events at the start of `data` (each its data lines' payload, b"" for an event
    without data, such as a comment), and where the incomplete rest begins."""
    out: list[bytes] = []
    pos = 0
    for m in _EVENT_END.finditer(data):
        lines = re.split(rb"\r\n|\n|\r", data[pos:m.start()])
        out.append(b"\n".join(ln[5:].removeprefix(b" ") for ln in lines if ln.startswith(b"data:")))
        pos = m.end()
    return out, pos


def _carries_something(payload: bytes) -> bool:
    """Whether a streamed event is more than the chat stream's opening role-only chunk: text, a tool
    call, a finish reason, an error, the end, or anything the router does not recognise."""
    if not payload:
        return False  # a comment or a keep-alive
    try:
        obj = json.loads(payload)
    except ValueError:
        return True  # ([DONE], or something unknown: the client's to see)
    if not isinstance(obj, dict) or "error" in obj or obj.get("usage"):
        return True
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return True
    for c in choices:
        if not isinstance(c, dict) or c.get("finish_reason") is not None or c.get("text"):
            return True
        delta = c.get("delta")
        if delta is not None and (not isinstance(delta, dict) or any(v for k, v in delta.items() if k != "role")):
            return True
    return False


async def _stream_head(chunks: AsyncIterator[bytes], sse: bool) -> bytes:
    """The stream's first bytes: for an event stream, every event up to the first that carries something
    (b"" for an empty stream). kvpool sends a chat stream's role-only chunk as soon as the request is
    queued, before any prefill: committing to the replica there would leave a request that dies or
    freezes in its queue unretried."""
    buf = b""
    while True:
        try:
            buf += await chunks.__anext__()
        except StopAsyncIteration:
            return buf
        if not sse or len(buf) > _HEAD_LIMIT:
            return buf
        events, _ = _events(buf)
        if any(_carries_something(e) for e in events):
            return buf


@dataclass
class _Upstream:
    """A replica's stream to the client: its first events (`head`), held back until one carried something,
    and the rest still to come."""

    name: str
    epoch: int  # the replica's `downs` when the request was sent
    resp: httpx.Response
    chunks: AsyncIterator[bytes]
    head: bytes
    sse: bool
    last_bytes_at: float = field(default_factory=time.monotonic)
    relayed: bool = False  # `_relay` has begun (and so closes it)

    async def next(self, router: Router) -> bytes | None:
        """The next bytes (None at the end); _Down once the replica has been marked down and this stream has
        sent nothing for `_STALLED_S` (a frozen replica never sends another byte, nor closes the
        connection; one marked down for other reasons, say missed health checks while busy, whose stream
        still flows, keeps it)."""
        rep = router.replicas[self.name]
        task = asyncio.ensure_future(self.chunks.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_POLL_S)
                if done:
                    self.last_bytes_at = time.monotonic()
                    try:
                        return task.result()
                    except StopAsyncIteration:
                        return None
                if rep.downs != self.epoch and time.monotonic() - self.last_bytes_at >= _STALLED_S:
                    raise _Down(f"replica {self.name} was marked down")
        finally:
            await cancel_and_wait(task)

    async def close(self, router: Router) -> None:
        try:
            await self.resp.aclose()  # (mid-answer: the replica aborts the request and frees its blocks)
        finally:
            router.done(self.name)


class _Down(Exception):
    pass


class _RelayResponse(StreamingResponse):
    """The relayed stream's response. A client that leaves between the headers and the body has the response
    cancelled before `_relay` begins, whose clean-up then never runs: the replica's answer is closed here
    instead (it aborts the request), and the router stops counting it in flight."""

    def __init__(self, up: _Upstream, router: Router, body: AsyncIterator[bytes], **kw: Any) -> None:
        super().__init__(body, **kw)
        self._up, self._router = up, router

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._up.relayed:
                with anyio.CancelScope(shield=True):
                    await self._up.close(self._router)


async def _relay(up: _Upstream, router: Router, take_up: Callable[[], Awaitable[_Upstream | None]] | None
                 ) -> AsyncIterator[bytes]:
    """The stream to the client, whole events at a time. When the replica fails mid-stream (the connection
    breaks, or it is marked down and stalls) the partial event it left is dropped; then `take_up` (for a
    request another replica answers with the same text: `kvpool.router.resume`) has another replica finish
    the stream, and otherwise, or if none can, the client's parser sees a clean error event, then the end.
    A stream whose end the client already has is not taken up."""
    up.relayed = True
    cursor = StreamText() if take_up is not None else None
    following = False  # relaying a replacement, through `cursor.follow`
    current: _Upstream | None = up  # (None once closed)
    try:
        while True:
            tail = b""  # the start of an event not yet complete
            try:
                data: bytes | None = up.head
                while data is not None:
                    if up.sse:
                        data = tail + data
                        payloads, end = _events(data)
                        if not following and len(data) - end > _HEAD_LIMIT:
                            end = len(data)  # no event boundary the router knows: pass it on as it is
                        data, tail = data[:end], data[end:]
                        if following:
                            assert cursor is not None
                            kept = (cursor.follow(p) for p in payloads)
                            data = b"".join(b"data: " + k + b"\n\n" for k in kept if k is not None)
                        elif cursor is not None:
                            for i, p in enumerate(payloads):
                                failed = _replica_failure(p)
                                if failed is not None:
                                    # The replica could not finish (its engine failed a step, or died): what
                                    # came before goes to the client, the rest from another replica.
                                    yield b"".join(b"data: " + q + b"\n\n" for q in payloads[:i] if q)
                                    raise _Down(f"replica {up.name} failed: {failed}")
                                cursor.sent(p)
                    if data:
                        yield data
                    data = await up.next(router)
                if following:
                    assert cursor is not None
                    if not cursor.complete():
                        raise Diverged("it ended before repeating the text already sent")
                elif tail:
                    yield tail  # (the replica's own last bytes, as it ended them)
                return
            except (httpx.HTTPError, _Down) as e:
                if isinstance(e, httpx.HTTPError):
                    router.mark_down(up.name)
                current = None
                await up.close(router)
                if cursor is not None and (cursor.done or cursor.finished):
                    if not cursor.done:
                        yield b"data: [DONE]\n\n"  # the client has the whole answer: only its end was owed
                    return
                nxt = await take_up() if take_up is not None else None
                if nxt is None:
                    yield _error_event(f"replica failed mid-stream: {e}")
                    return
                log.warning("router: replica %s failed mid-stream; %s finishes the stream", up.name, nxt.name)
                router.metrics.taken_up.labels(up.name).inc()
                assert cursor is not None
                cursor.restart()
                up = current = nxt
                following = True
            except Diverged as e:
                yield _error_event(f"replica failed mid-stream, and the replica that took the stream up "
                                   f"answered otherwise: {e}")
                return
    finally:
        if current is not None:
            await current.close(router)


def _replica_failure(payload: bytes) -> str | None:
    """The message of an in-band 503 error event (a kvpool replica's engine failed the request's step, or
    stopped), None for any other event."""
    if b'"error"' not in payload[:32]:
        return None
    try:
        err = json.loads(payload)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return str(err.get("message")) if isinstance(err, dict) and err.get("code") == 503 else None


def _error_event(message: str) -> bytes:
    return f"data: {json.dumps(APIError(503, message).body())}\n\ndata: [DONE]\n\n".encode()


@dataclass
class RouterHandle:
    url: str
    router: Router
    _server: Any
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self.router.stop()


def load_tokenizer(model: str | None, chat_template: str | None = None) -> Any:
    """The replicas' tokenizer, with their --chat-template in place of the model's if they set one."""
    from transformers import AutoTokenizer

    from kvpool.runner.model_files import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    if chat_template is not None:
        tok.chat_template = load_chat_template(chat_template)
    return tok


def start_router(router: Router, *, host: str = "127.0.0.1", port: int = 0, **kw: Any) -> RouterHandle:
    """The router on a background thread (tests, benchmarks); port 0 picks a free one."""
    import uvicorn

    router.start()
    app = create_app(router, **kw)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="kvpool-router-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            router.stop()
            raise RuntimeError(f"the router did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return RouterHandle(f"http://{host}:{bound}", router, server, thread)


def check_args(args: argparse.Namespace) -> None:
    """A ValueError naming the flag whose value cannot work (before anything starts)."""
    if args.block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {args.block_size}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"port: must be in 0-65535, got {args.port}")
    if args.max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: must be >= 1, got {args.max_body_bytes}")
    if args.max_store_blocks < 1:
        raise ValueError(f"max_store_blocks: must be >= 1, got {args.max_store_blocks}")
    if args.load_weight is None:
        args.load_weight = 1.0
    elif args.policy == "round-robin":
        raise ValueError("load_weight: --policy round-robin does not weigh load; leave the flag out, or route "
                         "with --policy cache")
    # (NaN compares false with everything: every replica's score is NaN, and the first one takes it all.)
    if not (math.isfinite(args.load_weight) and args.load_weight >= 0):
        raise ValueError(f"load_weight: must be a finite number >= 0, got {args.load_weight}")


def run(args: argparse.Namespace) -> None:
    import uvicorn

    specs = [ReplicaSpec.parse(s) for s in args.replica]
    check_args(args)
    tokenizer = load_tokenizer(args.model, args.chat_template)
    router = Router(specs, tokenizer=tokenizer, block_size=args.block_size, hash_algo=args.hash_algo,
                    hash_seed=args.hash_seed, beta=args.load_weight, policy=args.policy,
                    max_store_blocks=args.max_store_blocks)
    router.start()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not two lines per replica per health check
    log.info("routing to %d replicas on http://%s:%d", len(specs), args.host, args.port)
    try:
        uvicorn.run(create_app(router, max_body_bytes=args.max_body_bytes, api_key=args.api_key,
                               allowed_origins=args.allowed_origins),
                    host=args.host, port=args.port, log_level="info", lifespan="on")
    finally:
        router.stop()
