"""The router when a replica misbehaves without dying cleanly, with real replicas (real HTTP, real ZeroMQ
events) on 127.0.0.1, and a fake one (`fake_replica`) for the faults a real one cannot show:

- a replica that freezes with requests in flight (its engine stuck: /health answers, /metrics does not) is
  marked down by the health checks, and its requests that have sent the client nothing, a chat stream's
  role-only first event included, are cancelled there and served by another replica;
- a replica that answers 500 is retried elsewhere and, after a run of them, routed around;
- a stream cut in the middle of an event ends with a clean error event;
- a NaN gauge on one replica's /metrics does not end the health checks of the others;
- a replica that restarts has its old blocks forgotten as soon as it is back.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_replica import CUT_EVENT, FakeReplica
from replicas import free_port, start_front, start_replica, wait_until
from server_helpers import make_engine, metric

from kvpool.router import app
from kvpool.router.app import ReplicaSpec, RouterHandle
from kvpool.server.serve import ServerHandle, start_server

SYSTEM = "You are a careful assistant. " * 12  # > 3 blocks of 16 tokens


@pytest.fixture(scope="module")
def pair(chat_llama_dir: Path, chat_tokenizer: Any) -> Iterator[tuple[RouterHandle, list[ServerHandle]]]:
    reps = [start_replica(chat_llama_dir) for _ in range(2)]
    # Round-robin: which replica a request goes to is set by the test. Fast health checks: a frozen replica
    # is down after 3 missed checks of 0.3 s.
    front = start_front([s for _, s in reps], chat_tokenizer, policy="round-robin", health_interval_s=0.1,
                        health_timeout_s=0.3)
    yield front, [h for h, _ in reps]
    front.stop()
    for h, _ in reps:
        h.stop()


COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION),
                                       ("/v1/completions", {**COMPLETION, "stream": True}),
                                       ("/v1/chat/completions", {**CHAT, "stream": True})],
                         ids=["completions", "completions-stream", "chat-stream"])
def test_requests_on_a_replica_that_freezes_go_elsewhere(pair: tuple[RouterHandle, list[ServerHandle]], path: str,
                                                         body: dict[str, Any]) -> None:
    front, (frozen, other) = pair
    wait_until(lambda: all(r.healthy for r in front.router.replicas.values()))  # (after the previous case)
    retries = metric(front.url, "kvpool_router:retries_total")
    gate = threading.Event()
    frozen.engine.call_soon(lambda e: gate.wait(30))  # the engine is stuck; its HTTP server still answers
    front.router._rr = -1  # the next round-robin pick is the first replica: the frozen one
    t0 = time.monotonic()
    try:
        with httpx.stream("POST", f"{front.url}{path}", json=body, timeout=20) as r:
            raw = b"".join(r.iter_raw())
        took = time.monotonic() - t0
        assert r.status_code == 200, raw
        assert r.headers["x-kvpool-replica"] == other.url  # not the frozen one's role-only chunk, then a hang
        assert took < 8, took  # (down after ~1.2 s)
        assert not front.router.replicas[frozen.url].healthy
    finally:
        gate.set()
    direct = httpx.post(f"{other.url}{path}", json=body, timeout=20).content  # the same answer, straight
    if body.get("stream"):
        events = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), raw
        ch = [json.loads(e)["choices"][0] for e in events[:-1]]
        text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in ch)
        d_ch = [json.loads(ln[6:])["choices"][0] for ln in direct.decode().split("\n")
                if ln.startswith("data: {")]
        assert text == "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in d_ch)
        assert ch[0].get("delta", {}).get("role") == d_ch[0].get("delta", {}).get("role")  # (sent once)
    else:
        assert json.loads(raw)["choices"][0]["text"] == json.loads(direct)["choices"][0]["text"]
    assert metric(front.url, "kvpool_router:retries_total") == retries + 1
    # The frozen replica dropped the request when the router gave up on it, and comes back.
    wait_until(lambda: frozen.engine.num_pending == 0)
    wait_until(lambda: front.router.replicas[frozen.url].healthy)
    assert front.router.replicas[frozen.url].load.in_flight == 0


def stream_events(raw: bytes) -> list[str]:
    return [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]


def stream_text(events: list[str]) -> str:
    ch = [json.loads(e)["choices"][0] for e in events if e != "[DONE]" and json.loads(e)["choices"]]
    return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in ch)


def stream_from_a_replica_that_freezes(front: RouterHandle, frozen: ServerHandle, path: str,
                                       body: dict[str, Any]) -> bytes:
    """The router's stream of `body`, begun on `frozen`, whose engine sticks at its 4th step (the prefill and
    two more tokens have gone out) until the stream is over."""
    gate = threading.Event()
    llm = frozen.engine.engine
    step, steps = llm.step, []

    def step_then_freeze() -> Any:
        steps.append(1)
        if len(steps) == 4:
            gate.wait(30)
        return step()

    llm.step = step_then_freeze
    front.router._rr = -1  # round-robin's next pick: the frozen one
    try:
        with httpx.stream("POST", f"{front.url}{path}", json=body, timeout=20) as r:
            raw = b"".join(r.iter_raw())
        assert r.status_code == 200 and r.headers["x-kvpool-replica"] == frozen.url  # the stream began there
        return raw
    finally:
        gate.set()
        del llm.step


@pytest.mark.parametrize("path,body", [("/v1/completions", {**COMPLETION, "max_tokens": 24}),
                                       ("/v1/chat/completions", {**CHAT, "max_tokens": 24, "seed": 3,
                                                                 "temperature": 0.9})],
                         ids=["completions-greedy", "chat-seeded"])
def test_a_stream_whose_replica_freezes_mid_way_is_finished_by_another(
        pair: tuple[RouterHandle, list[ServerHandle]], path: str, body: dict[str, Any]) -> None:
    """The client has part of the answer when its replica freezes: another replica answers the same request
    (greedy, or seeded) with the same tokens, and the client gets the rest, under the first stream's id."""
    front, (frozen, other) = pair
    wait_until(lambda: all(r.healthy for r in front.router.replicas.values()))
    body = {**body, "stream": True, "ignore_eos": True}
    taken_up = metric(front.url, "kvpool_router:streams_taken_up_total", replica=frozen.url)
    events = stream_events(stream_from_a_replica_that_freezes(front, frozen, path, body))
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), events
    assert len({json.loads(e)["id"] for e in events[:-1]}) == 1  # one stream to the client
    direct = stream_events(httpx.post(f"{other.url}{path}", json=body, timeout=20).content)
    assert stream_text(events) == stream_text(direct) and stream_text(direct)
    if path.endswith("chat/completions"):
        roles = [json.loads(e)["choices"][0]["delta"].get("role") for e in events[:-1]]
        assert roles[0] == "assistant" and roles.count("assistant") == 1  # the role once, first
    assert metric(front.url, "kvpool_router:streams_taken_up_total", replica=frozen.url) == taken_up + 1
    wait_until(lambda: frozen.engine.num_pending == 0)  # it dropped the request when the router left it
    wait_until(lambda: front.router.replicas[frozen.url].healthy)
    assert front.router.replicas[frozen.url].load.in_flight == 0
    assert front.router.replicas[other.url].load.in_flight == 0


def test_a_stream_whose_replica_fails_a_step_is_finished_by_another(
        pair: tuple[RouterHandle, list[ServerHandle]]) -> None:
    """A kvpool replica whose engine fails a step sends the requests in it an error event (503) and recovers:
    a greedy stream is then finished by the other replica, the error never reaching the client."""
    front, (failing, other) = pair
    wait_until(lambda: all(r.healthy for r in front.router.replicas.values()))
    body = {**COMPLETION, "max_tokens": 16, "ignore_eos": True, "stream": True}
    taken_up = metric(front.url, "kvpool_router:streams_taken_up_total", replica=failing.url)
    llm = failing.engine.engine
    step, steps = llm.step, []

    def fourth_step_fails() -> Any:
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("boom")
        return step()

    llm.step = fourth_step_fails
    front.router._rr = -1
    try:
        with httpx.stream("POST", f"{front.url}/v1/completions", json=body, timeout=20) as r:
            raw = b"".join(r.iter_raw())
        assert r.headers["x-kvpool-replica"] == failing.url
    finally:
        del llm.step
    events = stream_events(raw)
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), raw
    direct = stream_events(httpx.post(f"{other.url}/v1/completions", json=body, timeout=20).content)
    assert stream_text(events) == stream_text(direct)
    assert metric(front.url, "kvpool_router:streams_taken_up_total", replica=failing.url) == taken_up + 1
    assert failing.engine.is_alive  # (it recovered; the router did not need to mark it down)


def test_a_sampled_stream_on_a_replica_that_freezes_ends_with_an_error(
        pair: tuple[RouterHandle, list[ServerHandle]]) -> None:
    """No seed: no other replica would repeat the text, so the client gets an error event once the frozen
    replica is marked down, not a stream that never ends."""
    front, (frozen, _) = pair
    wait_until(lambda: all(r.healthy for r in front.router.replicas.values()))
    body = {**CHAT, "temperature": 0.9, "max_tokens": 24, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    events = stream_events(stream_from_a_replica_that_freezes(front, frozen, "/v1/chat/completions", body))
    assert time.monotonic() - t0 < 8
    assert events[-1] == "[DONE]" and stream_text(events[:-2])
    err = json.loads(events[-2])["error"]
    assert err["code"] == 503 and err["message"] == f"replica failed mid-stream: replica {frozen.url} was marked down"
    wait_until(lambda: frozen.engine.num_pending == 0)
    wait_until(lambda: front.router.replicas[frozen.url].healthy)


class slowed:
    """A replica whose engine sleeps `s` before each step (a long answer streams for seconds)."""

    def __init__(self, handle: ServerHandle, s: float) -> None:
        self.llm, self.s = handle.engine.engine, s

    def __enter__(self) -> slowed:
        step = self.llm.step
        self.llm.step = lambda: (time.sleep(self.s), step())[1]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.llm.step


def test_a_client_leaving_mid_stream_stops_the_replica(pair: tuple[RouterHandle, list[ServerHandle]]) -> None:
    front, (home, _) = pair
    wait_until(lambda: all(r.healthy for r in front.router.replicas.values()))
    body = {**COMPLETION, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with slowed(home, 0.03):  # 200 tokens: 6 s or more
        front.router._rr = -1
        with httpx.stream("POST", f"{front.url}/v1/completions", json=body, timeout=20) as r:
            assert r.headers["x-kvpool-replica"] == home.url
            next(r.iter_raw())  # the first event, then the client goes
        t0 = time.monotonic()
        wait_until(lambda: home.engine.num_pending == 0, timeout=3)
        assert time.monotonic() - t0 < 3  # aborted there, not generated to the end for no one
    wait_until(lambda: front.router.replicas[home.url].load.in_flight == 0)


def test_a_flowing_stream_is_not_cut_when_its_replica_is_marked_down(
        pair: tuple[RouterHandle, list[ServerHandle]]) -> None:
    """Marked down for something else (three 500s on other requests, missed health checks while busy), a
    replica whose stream still flows keeps it: only a stream that also went silent has failed."""
    front, (home, _) = pair
    wait_until(lambda: all(r.healthy for r in front.router.replicas.values()))
    body = {**COMPLETION, "max_tokens": 10, "ignore_eos": True, "stream": True}
    taken_up = metric(front.url, "kvpool_router:streams_taken_up_total", replica=home.url)
    with slowed(home, 0.3):  # a token every 0.3 s: gaps the router notices, shorter than a stall
        front.router._rr = -1
        with httpx.stream("POST", f"{front.url}/v1/completions", json=body, timeout=20) as r:
            it = r.iter_raw()
            raw = next(it)
            front.router.mark_down(home.url)
            raw += b"".join(it)
    events = stream_events(raw)
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), raw
    direct = stream_events(httpx.post(f"{home.url}/v1/completions", json=body, timeout=20).content)
    assert stream_text(events) == stream_text(direct)
    assert metric(front.url, "kvpool_router:streams_taken_up_total", replica=home.url) == taken_up
    wait_until(lambda: front.router.replicas[home.url].healthy)


def test_a_replacement_that_cannot_stream_ends_the_stream_with_an_error(chat_tokenizer: Any) -> None:
    """The replica that was to take a stream up answers 404 (it lacks the adapter, say): the client gets an
    error event and the end, never that replica's JSON body spliced into its event stream."""
    cut, missing = FakeReplica("cutmid"), FakeReplica("err404")
    front = start_front([ReplicaSpec(cut.url), ReplicaSpec(missing.url)], chat_tokenizer, policy="round-robin")
    try:
        front.router._rr = -1
        with httpx.stream("POST", f"{front.url}/v1/completions", timeout=20,
                          json={"prompt": "x", "stream": True, "temperature": 0}) as r:
            raw = b"".join(r.iter_raw())
        assert raw.startswith(CUT_EVENT) and raw.endswith(b"data: [DONE]\n\n") and b"not_found" not in raw, raw
        assert json.loads(stream_events(raw)[1])["error"]["message"].startswith("replica failed mid-stream")
        assert missing.posts == 1
        wait_until(lambda: all(r.load.in_flight == 0 for r in front.router.replicas.values()))
    finally:
        front.stop()
        cut.stop()
        missing.stop()


def test_a_sampled_stream_cut_mid_way_is_not_finished_elsewhere(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    """Without a seed another replica would sample other text: the client gets an error event, not a splice;
    and a replacement whose text differs from what was sent (here a real replica after a fake one's
    " Hello") ends the stream the same way."""
    handle, server = start_replica(chat_llama_dir)
    cut = FakeReplica("cutmid")
    front = start_front([ReplicaSpec(cut.url), server], chat_tokenizer, policy="round-robin")
    try:
        for body, why in (({"prompt": "x", "stream": True, "max_tokens": 4}, "replica failed mid-stream: "),
                          ({"prompt": "x", "stream": True, "max_tokens": 4, "temperature": 0},
                           "answered otherwise: its text differs from the text already sent")):
            front.router._rr = -1  # the cutting one first
            with httpx.stream("POST", f"{front.url}/v1/completions", json=body, timeout=20) as r:
                raw = b"".join(r.iter_raw())
            events = stream_events(raw)
            assert raw.startswith(CUT_EVENT) and events[-1] == "[DONE]" and len(events) == 3, raw
            assert why in json.loads(events[1])["error"]["message"]
            wait_until(lambda: front.router.replicas[cut.url].healthy)
        assert metric(front.url, "kvpool_router:streams_taken_up_total", replica=cut.url) == 1
        wait_until(lambda: front.router.replicas[server.url].load.in_flight == 0)
    finally:
        front.stop()
        cut.stop()
        handle.stop()


def test_a_replica_answering_500_is_retried_and_routed_around(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    good, _ = start_replica(chat_llama_dir, events=False)
    bad = FakeReplica("err500")
    front = start_front([ReplicaSpec(bad.url), ReplicaSpec(good.url)], chat_tokenizer, policy="round-robin")
    try:
        served = []
        for i in range(6):
            r = httpx.post(f"{front.url}/v1/completions", json={"prompt": f"x {i}", "max_tokens": 1}, timeout=30)
            assert r.status_code == 200, r.text
            served.append(r.headers["x-kvpool-replica"])
        assert served == [good.url] * 6
        # Each 500 counts as a failure; the third in a row marks it down (the health checks bring it back).
        assert bad.posts == 3 and front.router.replicas[bad.url].failures == 3
        assert metric(front.url, "kvpool_router:retries_total") == 3
    finally:
        front.stop()
        bad.stop()
        good.stop()
    # Only replicas that fail: the client gets the last one's own error.
    bad2 = FakeReplica("err500")
    front = start_front([ReplicaSpec(bad2.url)], chat_tokenizer)
    try:
        r = httpx.post(f"{front.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: boom"
        assert metric(front.url, "kvpool_router:retries_total") == 0  # (no other replica took it)
    finally:
        front.stop()
        bad2.stop()


def test_a_stream_cut_mid_event_ends_with_a_clean_error(chat_tokenizer: Any) -> None:
    cut = FakeReplica("cutmid")
    front = start_front([ReplicaSpec(cut.url)], chat_tokenizer)
    try:
        with httpx.stream("POST", f"{front.url}/v1/completions", json={"prompt": "x", "stream": True},
                          timeout=20) as r:
            raw = b"".join(r.iter_raw())
        events = raw.split(b"\n\n")
        assert raw.startswith(CUT_EVENT) and raw.endswith(b"\n\n") and events[-2:] == [b"data: [DONE]", b""]
        err = json.loads(events[1].removeprefix(b"data: "))["error"]  # the half event is not relayed
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == 503 and err["type"] == "service_unavailable" and err["param"] is None
        assert err["message"].startswith("replica failed mid-stream")
        assert len(events) == 4
    finally:
        front.stop()
        cut.stop()


def test_a_nan_gauge_does_not_stop_the_health_checks(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    odd = FakeReplica("err500", metrics=b"kvpool:num_requests_running NaN\nkvpool:num_requests_waiting +Inf\n"
                                        b"kvpool:kv_cache_usage_perc 0.5\n")
    h, spec = start_replica(chat_llama_dir, events=False)
    front = start_front([ReplicaSpec(odd.url), spec], chat_tokenizer, health_interval_s=0.05)
    try:
        wait_until(lambda: front.router.replicas[odd.url].load.kv_usage == 0.5)
        assert front.router.replicas[odd.url].load.running == 0 and front.router.replicas[odd.url].healthy
        assert front.router._health_thread.is_alive()
        h.stop()  # the health checks go on, and notice
        wait_until(lambda: not front.router.replicas[h.url].healthy, timeout=5)
    finally:
        front.stop()
        odd.stop()


def test_a_failing_health_check_counts_as_missed(chat_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rep = FakeReplica("err500")
    front = start_front([ReplicaSpec(rep.url)], chat_tokenizer, health_interval_s=0.05)
    try:
        def broken(text: str) -> dict[str, float]:
            raise RuntimeError("unexpected")

        monkeypatch.setattr(app, "_read_metrics", broken)
        wait_until(lambda: not front.router.replicas[rep.url].healthy, timeout=5)  # 3 checks missed
        assert front.router._health_thread.is_alive()
        monkeypatch.undo()
        wait_until(lambda: front.router.replicas[rep.url].healthy, timeout=5)
    finally:
        front.stop()
        rep.stop()


def restartable_replica(model_dir: Path) -> tuple[Callable[[], ServerHandle], str, str]:
    """A replica with KV events that can be started again on the same port and endpoints (a restart)."""
    port = free_port()
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"

    def start() -> ServerHandle:
        return start_server(make_engine(model_dir, enable_kv_events=True), served_model_name="tiny", port=port,
                            kv_events_endpoint=pub, kv_events_replay_endpoint=replay)

    return start, pub, replay


def test_a_restarted_replica_has_its_old_blocks_forgotten(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    start, pub, replay = restartable_replica(chat_llama_dir)
    h = start()
    front = start_front([ReplicaSpec(h.url, events=pub, replay=replay)], chat_tokenizer, health_interval_s=0.1)
    try:
        r = httpx.post(f"{h.url}/v1/completions", json={"prompt": SYSTEM, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
        wait_until(lambda: front.router.index.num_blocks(h.url) >= 3)
        h.stop()
        wait_until(lambda: not front.router.replicas[h.url].healthy)
        h = start()  # empty caches, and no event yet
        wait_until(lambda: front.router.replicas[h.url].healthy)
        wait_until(lambda: front.router.index.num_blocks(h.url) == 0, timeout=2)
        assert front.router.replicas[h.url].subscriber.alive  # type: ignore[union-attr]
        # Its new blocks are learned as before.
        r = httpx.post(f"{h.url}/v1/completions", json={"prompt": SYSTEM, "max_tokens": 1}, timeout=60)
        wait_until(lambda: front.router.index.num_blocks(h.url) >= 3)
    finally:
        front.stop()
        h.stop()


def test_a_restart_between_two_health_checks_is_seen_by_the_stream_id_on_health(
        chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    """The replica restarts while no check looks (here: one check an hour) and sends no event yet: its
    sequence numbers cannot tell, but /health names the new stream, and the next check forgets its blocks."""
    start, pub, replay = restartable_replica(chat_llama_dir)
    h = start()
    first = httpx.get(f"{h.url}/health").headers["kvpool-instance"]
    front = start_front([ReplicaSpec(h.url, events=pub, replay=replay)], chat_tokenizer, health_interval_s=3600)
    try:
        rep = front.router.replicas[h.url]
        wait_until(lambda: rep.instance == first)
        r = httpx.post(f"{h.url}/v1/completions", json={"prompt": SYSTEM, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
        wait_until(lambda: front.router.index.num_blocks(h.url) >= 3)
        h.stop()
        h = start()
        assert httpx.get(f"{h.url}/health").headers["kvpool-instance"] not in (first, "")
        time.sleep(0.3)
        assert front.router.index.num_blocks(h.url) >= 3  # nothing told the router yet
        with httpx.Client(timeout=5) as client:
            front.router._check(client, rep)
        assert rep.healthy and rep.instance != first
        wait_until(lambda: front.router.index.num_blocks(h.url) == 0, timeout=2)
    finally:
        front.stop()
        h.stop()


def test_models_pins_and_reset_do_not_wait_on_a_frozen_replica(pair: tuple[RouterHandle, list[ServerHandle]],
                                                               chat_tokenizer: Any) -> None:
    """A replica that accepts connections and never answers, listed first: requests sent to it before the
    health checks mark it down are given up once they do (they waited forever), and answered without it.
    (The reset goes in a round of its own: run beside a pin, it may drop the prefix the pin computes.)"""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(64)  # (the kernel completes the handshakes; nobody reads)
    dead = f"http://127.0.0.1:{frozen.getsockname()[1]}"
    good = pair[1][1].url

    def at_once(calls: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
        """The calls sent together through a new router, before its health checks can know the replica."""
        front = start_front([ReplicaSpec(dead), ReplicaSpec(good)], chat_tokenizer, health_interval_s=0.1,
                            health_timeout_s=0.3)
        try:
            with ThreadPoolExecutor(len(calls)) as pool:
                futures = [pool.submit(httpx.request, m, f"{front.url}{p}", json=b, timeout=20) for m, p, b in calls]
                out = [f.result() for f in futures]
            assert not front.router.replicas[dead].healthy
            for r in out:  # (a pin made is unpinned again, on every replica that holds it)
                if r.request.method == "POST" and r.url.path == "/v1/pins" and r.status_code == 200:
                    httpx.delete(f"{front.url}/v1/pins/{r.json()['id']}", timeout=10)
            return out
        finally:
            front.stop()

    try:
        models, pins, pin = at_once([("GET", "/v1/models", None), ("GET", "/v1/pins", None),
                                     ("POST", "/v1/pins", {"prompt": SYSTEM, "ttl": 30})])
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        assert pins.status_code == 200 and pins.json()["object"] == "list"  # (with the new pin or not: concurrent)
        assert pin.status_code == 200 and list(pin.json()["replicas"]) == [good]
        (reset,) = at_once([("POST", "/reset_prefix_cache", None)])
        assert reset.status_code == 409 and f"{dead}': 'unreachable" in reset.json()["error"]["message"]
    finally:
        frozen.close()
