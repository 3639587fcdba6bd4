"""The router between real processes' worth of servers: two kvpool replicas (real HTTP, real ZeroMQ
events) behind `kvpool router`, all on 127.0.0.1.

- a conversation's next turn goes to the replica that cached the previous one (by its events), and the
  answer is the one a replica gives directly, streamed or not;
- one hot prefix for every request does not pile onto one replica;
- a replica without events is routed by what the router sent it (the approximate index);
- a replica that dies is routed around, and requests that had not started streaming are retried;
- the router started after its replicas learns their caches through the replay socket;
- pins and the cache reset reach every replica, and a replica that comes back (or restarts) gets the
  live pins again;
- /metrics and bad input.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import fail_first_step
from replicas import free_port, start_front, start_replica, wait_until
from server_helpers import leave_early, make_engine, metric

from kvpool.router import admin
from kvpool.router.app import ReplicaSpec, RouteKey, Router, RouterHandle, start_router
from kvpool.server.serve import ServerHandle, start_server

SYSTEM = "You are a careful assistant. " * 12  # > 3 blocks of 16 tokens


@pytest.fixture(scope="module")
def cluster(chat_llama_dir: Path, chat_tokenizer: Any) -> Iterator[tuple[RouterHandle, list[ServerHandle]]]:
    reps = [start_replica(chat_llama_dir) for _ in range(2)]
    front = start_front([s for _, s in reps], chat_tokenizer)
    time.sleep(0.3)  # subscribers connected (the replay covers anything earlier anyway)
    yield front, [h for h, _ in reps]
    front.stop()
    for h, _ in reps:
        h.stop()


def chat(url: str, messages: list[dict[str, str]], headers: dict[str, str] | None = None, **kw: Any
         ) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                           **kw}, headers=headers, timeout=60)


def wait_indexed(front: RouterHandle, replica: str, at_least: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while front.router.index.num_blocks(replica) < at_least:
        assert time.monotonic() < deadline, "events did not reach the router"
        time.sleep(0.02)


def test_next_turn_follows_the_cache(cluster: tuple[RouterHandle, list[ServerHandle]]) -> None:
    front, reps = cluster
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache? " * 3}]
    r1 = chat(front.url, turn1)
    assert r1.status_code == 200, r1.text
    home = r1.headers["x-kvpool-replica"]
    wait_indexed(front, home, 3)
    other = next(h.url for h in reps if h.url != home)
    # Make the cache's home busier than the other replica by a little: the cache must still win.
    turn2 = [*turn1, {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And why page it?"}]
    r2 = chat(front.url, turn2)
    assert r2.headers["x-kvpool-replica"] == home
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 16
    direct = chat(other, turn2)  # the same answer from the other replica, computed from scratch
    assert direct.json()["choices"][0]["message"]["content"] == r2.json()["choices"][0]["message"]["content"]
    # Streaming through the router: the same text, SSE chunks ending in [DONE].
    with httpx.stream("POST", f"{front.url}/v1/chat/completions", timeout=60,
                      json={"messages": turn2, "max_tokens": 6, "temperature": 0, "stream": True}) as s:
        # (The third request for this prefix in a row may go to the other replica: load evens out.)
        assert s.status_code == 200 and s.headers["x-kvpool-replica"] in (home, other)
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content", "") for ln in lines[:-1])
    assert text == r2.json()["choices"][0]["message"]["content"]
    assert metric(front.url, "kvpool_router:matched_blocks_total") >= 3


def test_hot_prefix_is_spread(cluster: tuple[RouterHandle, list[ServerHandle]]) -> None:
    front, _ = cluster
    before = {n: r.routed for n, r in front.router.replicas.items()}
    for i in range(12):  # one shared prefix, sent one after another (in-flight is 0 at every decision)
        r = httpx.post(f"{front.url}/v1/completions", timeout=60,
                       json={"prompt": SYSTEM + f" question {i}", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
    counts = [r.routed - before[n] for n, r in front.router.replicas.items()]
    assert max(counts) <= 1.5 * (sum(counts) / len(counts)), counts


def test_metrics_and_bad_input(cluster: tuple[RouterHandle, list[ServerHandle]]) -> None:
    front, reps = cluster
    # One request straight to each replica: their events reach the router whoever sent the request, so this
    # test does not depend on the ones before it (pytest -n may give it a cluster of its own).
    for h in reps:
        assert chat(h.url, [{"role": "user", "content": SYSTEM + "metrics"}]).status_code == 200
    deadline = time.monotonic() + 5.0
    while front.router._checked_hash != {h.url for h in reps}:
        assert time.monotonic() < deadline, "events did not reach the router"
        time.sleep(0.02)
    assert metric(front.url, "kvpool_router:replica_healthy") == 2
    assert metric(front.url, "kvpool_router:event_batches_total") >= 1
    assert metric(front.url, "kvpool_router:hash_mismatches_total") == 0
    assert front.router._checked_hash == {h.url for h in reps}  # both replicas' hashes were reproduced
    r = httpx.post(f"{front.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("body")
    r = httpx.post(f"{front.url}/v1/completions", json={"prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # the replica's own 400
    assert httpx.get(f"{front.url}/v1/models").json()["data"][0]["id"] == "tiny"
    with pytest.raises(ValueError, match="replica"):
        Router([])


def test_replica_without_events_uses_the_routed_index(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    reps = [start_replica(chat_llama_dir, events=False) for _ in range(2)]
    front = start_front([s for _, s in reps], chat_tokenizer, recent_half_life_s=0.1)
    try:
        homes = []
        for i in range(3):
            prompt = SYSTEM + " and again" * i
            r = httpx.post(f"{front.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
            homes.append(r.headers["x-kvpool-replica"])
            time.sleep(0.6)  # the decayed load of the last choice fades, as between turns of a chat
        assert len(set(homes)) == 1, homes
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 16
    finally:
        front.stop()
        for h, _ in reps:
            h.stop()


def test_dead_replica_is_routed_around(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    reps = [start_replica(chat_llama_dir) for _ in range(2)]
    # Health checks far apart: the router learns of the death from the failed requests themselves.
    front = start_front([s for _, s in reps], chat_tokenizer, health_interval_s=60)
    try:
        time.sleep(0.2)
        dead = reps[0][0]
        dead.stop()
        outs = []
        for i in range(4):
            body = {"prompt": f"count {i} " * 10, "max_tokens": 3, "temperature": 0, "stream": i % 2 == 1}
            r = httpx.post(f"{front.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvpool-replica"] == reps[1][0].url
            outs.append(r)
        assert not front.router.replicas[dead.url].healthy
        assert metric(front.url, "kvpool_router:retries_total") >= 1
        reps[1][0].stop()
        r = httpx.post(f"{front.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
    finally:
        front.stop()


def test_late_router_replays_what_replicas_cached(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    h, spec = start_replica(chat_llama_dir)
    try:
        r = httpx.post(f"{h.url}/v1/completions", json={"prompt": SYSTEM, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
        time.sleep(0.2)
        front = start_front([spec], chat_tokenizer)
        try:
            wait_indexed(front, h.url, 3)
            hashes = front.router.block_hashes(list(chat_tokenizer.encode(SYSTEM)), None)
            assert front.router.index.match(hashes, [h.url])[h.url][0] == len(hashes)
        finally:
            front.stop()
    finally:
        h.stop()


def test_round_robin_policy_alternates(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    specs = [ReplicaSpec("http://127.0.0.1:9"), ReplicaSpec("http://127.0.0.1:10")]
    r = Router(specs, tokenizer=chat_tokenizer, policy="round-robin")
    picks = [r.pick(RouteKey([b"x"]), set()) for _ in range(4)]
    assert Counter(p[0] for p in picks if p) == Counter({specs[0].url: 2, specs[1].url: 2})


def test_the_router_closes_its_connections_to_the_replicas_when_it_stops(chat_llama_dir: Path,
                                                                          chat_tokenizer: Any) -> None:
    h, spec = start_replica(chat_llama_dir, events=False)
    front = start_front([spec], chat_tokenizer)
    try:
        r = httpx.post(f"{front.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
        client = front._server.config.app.state.client
        assert not client.is_closed
    finally:
        front.stop()
        h.stop()
    assert client.is_closed


def test_the_router_api_key(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    """--api-key: every route but /health and /metrics (open to probes and scrapers) needs the key: the API,
    /router/state, the cache reset (an OpenAI 401 before anything reaches a replica)."""
    h, spec = start_replica(chat_llama_dir, events=False)
    front = start_router(Router([spec], tokenizer=chat_tokenizer, block_size=16), api_key="sesame")
    try:
        body = {"prompt": "hi", "max_tokens": 1}
        for path, method in (("/v1/completions", "POST"), ("/v1/models", "GET"), ("/router/state", "GET"),
                             ("/reset_prefix_cache", "POST"), ("/v1/pins", "GET")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
                r = httpx.request(method, f"{front.url}{path}", json=body if method == "POST" else None,
                                  headers=headers, timeout=60)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["message"] == ("Incorrect API key provided; send it as "
                                                        "'Authorization: Bearer KEY'")
        assert front.router.replicas[spec.url].routed == 0  # nothing was routed
        ok = {"Authorization": "Bearer sesame"}
        assert httpx.post(f"{front.url}/v1/completions", json=body, headers=ok, timeout=60).status_code == 200
        assert httpx.get(f"{front.url}/router/state", headers=ok).json()[spec.url]["routed"] == 1
        assert httpx.get(f"{front.url}/health").status_code == 200
        assert httpx.get(f"{front.url}/metrics").status_code == 200
    finally:
        front.stop()
        h.stop()


def test_kvpool_router_command(chat_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI as a separate process in front of a replica; and a bad --replica is a clear error."""
    import subprocess
    import sys

    from replicas import free_port

    from kvpool.cli import main

    assert main(["router", "--replica", "localhost:8000"]) == 2
    assert "replica: 'localhost:8000' must start with an http" in capsys.readouterr().err
    h, spec = start_replica(chat_llama_dir)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "router", "--port", str(port), "--model",
                             str(chat_llama_dir), "--replica", f"{spec.url},events={spec.events},replay={spec.replay}",
                             "--api-key", "k"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert chat(url, [{"role": "user", "content": "hi"}]).status_code == 401  # --api-key k
        key = {"headers": {"Authorization": "Bearer k"}}
        r = chat(url, [{"role": "user", "content": "hello " * 40}], **key)
        assert r.status_code == 200 and r.headers["x-kvpool-replica"] == h.url
        r = chat(url, [{"role": "user", "content": "hello " * 40}], **key)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        assert metric(url, "kvpool_router:matched_blocks_total") >= 1  # the CLI's tokenizer hashes as the replica
    finally:
        proc.terminate()
        proc.wait(20)
        h.stop()


def test_router_errors_are_openai_errors(cluster: tuple[RouterHandle, list[ServerHandle]]) -> None:
    front, _ = cluster
    # Token ids no tokenizer makes: routed without hashes, and the replica's 400 names the field.
    r = httpx.post(f"{front.url}/v1/completions", json={"prompt": [1, 10**30], "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    for r, status in ((httpx.post(f"{front.url}/v1/embeddings", json={}), 404),
                      (httpx.get(f"{front.url}/v1/completions"), 405)):
        assert r.status_code == status and r.json()["error"]["code"] == status

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(16):
            yield b"a" * (1 << 20)  # chunked: refused while reading, at the limit (4 MiB), not after 16

    assert httpx.post(f"{front.url}/v1/completions", content=chunks()).status_code == 413


# A stream whose first bytes never come while the client is there: a stop string longer than the answer holds
# back all of its text (as a long queue wait or prefill would delay it).
@pytest.mark.parametrize("extra", [{}, {"stream": True, "stop": "Z" * 2000}], ids=["non-streaming", "streaming"])
def test_a_client_leaving_before_the_first_byte_aborts_it_on_the_replica(
        cluster: tuple[RouterHandle, list[ServerHandle]], extra: dict) -> None:
    front, reps = cluster
    before = sum(metric(h.url, "kvpool:generation_tokens_total") for h in reps)
    leave_early(f"{front.url}/v1/completions", {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True,
                                                "temperature": 0, **extra}, reps)
    assert sum(metric(h.url, "kvpool:generation_tokens_total") for h in reps) - before < 480  # stopped early


def test_pins_and_the_cache_reset_reach_every_replica(cluster: tuple[RouterHandle, list[ServerHandle]]) -> None:
    front, reps = cluster
    prompt = list(range(2000, 2000 + 16 * 3 + 1))  # 3 full blocks
    r = httpx.post(f"{front.url}/v1/pins", json={"prompt": prompt, "ttl": 600}, timeout=60)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["id"].startswith("rpin-") and pin["num_blocks"] == 3 and pin["missing"] == []
    assert set(pin["replicas"]) == {h.url for h in reps}
    for h in reps:
        assert [p["id"] for p in httpx.get(f"{h.url}/v1/pins").json()["data"]] == [pin["replicas"][h.url]]
    assert [p["id"] for p in httpx.get(f"{front.url}/v1/pins").json()["data"]] == [pin["id"]]
    assert httpx.delete(f"{front.url}/v1/pins/{pin['id']}").json()["deleted"] is True
    for h in reps:
        assert httpx.get(f"{h.url}/v1/pins").json()["data"] == []
    for pid in (pin["id"], "%2F"):  # (a slash too: the same 404 body, not a redirect)
        r = httpx.delete(f"{front.url}/v1/pins/{pid}")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", pid
    r = httpx.post(f"{front.url}/v1/pins", json={"prompt": [1, 2, 3]})  # every replica refuses it alike
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{front.url}/v1/pins", content=b'{"prompt": ')  # not JSON: each replica's 400, relayed
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("body: invalid JSON"), r.text
    assert httpx.post(f"{front.url}/reset_prefix_cache").json() == {"reset": True, "replicas": 2}


def test_a_pin_one_replica_refuses_is_undone_on_the_others(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    # 255 usable blocks each: a budget of 50% (127 blocks) and one of 1% (2 blocks). A 4-block pin fits
    # the first only: refused as a whole, with the second replica's 409, and unpinned on the first.
    reps = [start_replica(chat_llama_dir, events=False, pin_budget=b) for b in (0.5, 0.01)]
    front = start_front([s for _, s in reps], chat_tokenizer)
    try:
        r = httpx.post(f"{front.url}/v1/pins", json={"prompt": list(range(3000, 3000 + 16 * 4))}, timeout=60)
        assert r.status_code == 409 and "pin budget of 2 blocks" in r.json()["error"]["message"], r.text
        for h, _ in reps:
            assert httpx.get(f"{h.url}/v1/pins").json()["data"] == []
        assert httpx.get(f"{front.url}/v1/pins").json()["data"] == []
    finally:
        front.stop()
        for h, _ in reps:
            h.stop()


def test_a_replica_failing_the_pin_is_missing_not_a_refusal(chat_llama_dir: Path, chat_tokenizer: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica whose engine fails the step computing the prefix answers 503: a fault of that replica, not
    an answer to the pin. The healthy replica keeps its pin, the failing one is `missing`, and once its engine
    has recovered the keeper pins it there too."""
    monkeypatch.setattr(admin, "PIN_CHECK_S", 0.1)
    reps = [start_replica(chat_llama_dir, events=False) for _ in range(2)]
    (ok, _), (failing, _) = reps
    front = start_front([s for _, s in reps], chat_tokenizer)
    try:
        wait_until(lambda: all(r.healthy for r in front.router.replicas.values()))
        fail_first_step(failing.engine.engine)
        r = httpx.post(f"{front.url}/v1/pins", json={"prompt": list(range(5000, 5000 + 16 * 2 + 1)), "ttl": 600},
                       timeout=60)
        assert r.status_code == 200, r.text
        pin = r.json()
        assert list(pin["replicas"]) == [ok.url] and pin["missing"] == [failing.url]
        assert [p["id"] for p in httpx.get(f"{ok.url}/v1/pins").json()["data"]] == [pin["replicas"][ok.url]]
        again = wait_until(lambda: httpx.get(f"{failing.url}/v1/pins").json()["data"], timeout=20.0)
        assert len(again) == 1 and again[0]["num_blocks"] == 2
    finally:
        front.stop()
        for h, _ in reps:
            h.stop()


def test_a_replica_that_comes_back_or_restarts_gets_the_live_pins(
        chat_llama_dir: Path, chat_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin, "PIN_CHECK_S", 0.1)
    up, _ = start_replica(chat_llama_dir, events=False)
    port = free_port()
    late_url = f"http://127.0.0.1:{port}"  # nothing listens there yet
    front = start_front([ReplicaSpec(up.url), ReplicaSpec(late_url)], chat_tokenizer)
    late = None

    def held(h: ServerHandle) -> list[dict[str, Any]]:
        try:
            return httpx.get(f"{h.url}/v1/pins").json()["data"]
        except httpx.HTTPError:
            return []

    try:
        prompt = list(range(4000, 4000 + 16 * 2 + 1))  # 2 full blocks
        r = httpx.post(f"{front.url}/v1/pins", json={"prompt": prompt, "ttl": 600}, timeout=60)
        assert r.status_code == 200, r.text
        pin = r.json()
        assert pin["missing"] == [late_url] and list(pin["replicas"]) == [up.url]
        late = start_server(make_engine(chat_llama_dir), served_model_name="tiny", port=port)
        first = wait_until(lambda: held(late), timeout=20.0)
        assert len(first) == 1 and first[0]["num_blocks"] == 2 and 590 < first[0]["expires_in"] < 600
        # The router names the new pin, and the replica that held it all along still holds its first one.
        listed = wait_until(lambda: (d := httpx.get(f"{front.url}/v1/pins").json()["data"])[0]["missing"] == [] and d,
                            timeout=20.0)
        assert listed[0]["replicas"] == {up.url: pin["replicas"][up.url], late_url: first[0]["id"]}
        assert [p["id"] for p in held(up)] == [pin["replicas"][up.url]]

        late.stop()  # a restart: the fresh process holds no pins, and gets this one again
        late = start_server(make_engine(chat_llama_dir), served_model_name="tiny", port=port)
        again = wait_until(lambda: held(late), timeout=20.0)
        assert len(again) == 1 and again[0]["num_blocks"] == 2
        wait_until(lambda: httpx.get(f"{front.url}/v1/pins").json()["data"][0]["replicas"].get(late_url)
                   == again[0]["id"], timeout=20.0)
        # Unpinned through the router: gone everywhere, and not made again.
        assert httpx.delete(f"{front.url}/v1/pins/{pin['id']}").json()["deleted"] is True
        time.sleep(0.5)
        assert held(up) == [] and held(late) == []
    finally:
        front.stop()
        up.stop()
        if late is not None:
            late.stop()


def test_an_overloaded_replicas_reason_reaches_the_client(chat_llama_dir: Path, chat_tokenizer: Any) -> None:
    h = start_server(make_engine(chat_llama_dir), served_model_name="tiny", max_pending=1)
    front = start_front([ReplicaSpec(h.url)], chat_tokenizer)
    gate = threading.Event()
    h.engine.call_soon(lambda e: gate.wait(30))  # the engine holds between steps: the first request stays
    first = threading.Thread(target=lambda: httpx.post(f"{h.url}/v1/completions", timeout=60,
                                                       json={"prompt": "x", "max_tokens": 1}))
    try:
        first.start()
        deadline = time.monotonic() + 10
        while not h.engine.num_pending:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(f"{front.url}/v1/completions", json={"prompt": "y", "max_tokens": 1}, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["message"].startswith("server overloaded"), r.text
    finally:
        gate.set()
        first.join()
        front.stop()
        h.stop()
