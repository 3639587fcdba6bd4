"""The router's index and policy on their own: event bookkeeping per tier, longest prefix, and the
prefix/load trade-off (a hot prefix spreads; a long cached prefix wins over a small load difference)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.core.hashing import BlockHasher
from kvpool.core.request import CacheRequest
from kvpool.router.app import ReplicaSpec, RouteKey, Router, _read_metrics
from kvpool.router.index import STORE, PrefixIndex, RoutedIndex
from kvpool.router.policy import ReplicaLoad, choose

H = [bytes([i]) * 4 for i in range(8)]


def stored(hashes: list[bytes], medium: str = "GPU") -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
            "block_size": 4, "lora_id": None, "medium": medium, "lora_name": None}


def test_index_counts_copies_and_tiers() -> None:
    ix = PrefixIndex()
    ix.apply("a", [stored(H[:4]), stored(H[:2])])  # vLLM reports duplicate copies too
    ix.apply("a", [{"type": "BlockRemoved", "block_hashes": H[:2], "medium": "GPU"}])
    assert ix.match(H, ["a"])["a"][0] == 4  # one copy of H[0..1] is left
    ix.apply("a", [{"type": "BlockRemoved", "block_hashes": [H[1]], "medium": "GPU"}])
    assert ix.match(H, ["a"])["a"][0] == 1
    ix.apply("a", [stored([H[1]], "CPU")])
    n, w = ix.match(H, ["a"])["a"]
    assert n == 4 and w == pytest.approx(3.8)  # a host hit is worth less than a device hit
    ix.apply("b", [stored(H[:3], "STORAGE")])  # the shared store counts for every replica
    assert ix.match(H, ["b", "c"]) == {"b": (3, 1.5), "c": (3, 1.5)}
    ix.apply("a", [{"type": "AllBlocksCleared"}])
    assert ix.match(H, ["a"])["a"][0] == 3  # only the store's blocks are left
    assert ix.num_blocks("a") == 0


def test_the_store_is_remembered_once_per_hash_and_within_a_bound() -> None:
    ix = PrefixIndex(max_store_blocks=3)
    # Two replicas wrote the same blocks to the shared store: it holds each once, and one removal (from a
    # consumer that reports the store's evictions) drops it.
    ix.apply("a", [stored(H[:2], "STORAGE")])
    ix.apply("b", [stored(H[:2], "STORAGE")])
    ix.apply("b", [{"type": "BlockRemoved", "block_hashes": [H[1]], "medium": "STORAGE"}])
    assert ix.match(H, ["c"])["c"] == (1, 0.5) and ix.num_blocks(STORE) == 1
    # A store evicts without an event: past the bound the least recently stored hash is forgotten first.
    ix.apply("a", [stored([H[1], H[2]], "STORAGE")])  # H0, H1, H2
    ix.apply("b", [stored([H[0]], "STORAGE")])  # written again: H1, H2, H0
    ix.apply("a", [stored([H[3]], "STORAGE")])  # H1 goes
    assert ix.num_blocks(STORE) == 3 and ix.match(H, ["c"])["c"] == (1, 0.5)
    assert ix.match([H[2], H[0], H[3]], ["c"])["c"] == (3, 1.5)
    ix.apply("a", [stored(H[:1])])  # a device copy beside the store's: a gets the device's weight
    assert ix.match(H[:1], ["a", "c"]) == {"a": (1, 1.0), "c": (1, 0.5)}
    with pytest.raises(ValueError, match="max_store_blocks"):
        PrefixIndex(max_store_blocks=0)


def test_routed_index_expires() -> None:
    ri = RoutedIndex(ttl_s=10)
    ri.record("a", H[:3], now=0.0)
    assert ri.match(H, "a", now=5.0) == 3 and ri.match(H, "a", now=11.0) == 0 and ri.match(H, "b", now=1) == 0


def test_hot_prefix_spreads_but_long_prefix_wins() -> None:
    loads = {"a": ReplicaLoad(), "b": ReplicaLoad()}
    matched: dict[str, tuple[int, float]] = {"a": (9, 9.0), "b": (0, 0.0)}
    assert choose(["a", "b"], matched, loads, 10).replica == "a"  # equal load: the cache decides
    loads["a"].in_flight = 2
    assert choose(["a", "b"], matched, loads, 10).replica == "b"  # a runs ahead: the idle one takes it
    loads["a"].in_flight, loads["b"].in_flight = 3, 2
    assert choose(["a", "b"], matched, loads, 10).replica == "a"  # a small difference: the cache still wins
    # Everything cold and idle: ties rotate.
    cold = {"a": ReplicaLoad(), "b": ReplicaLoad()}
    assert {choose(["a", "b"], {}, cold, 10, tie_break=i).replica for i in range(4)} == {"a", "b"}


def test_load_never_vanishes_between_paced_requests() -> None:
    ld = ReplicaLoad()
    ld.recent, ld.recent_at = 1.0, 0.0
    ld.decay(2.0, half_life_s=2.0)
    assert ld.load == pytest.approx(0.5)


def test_replica_spec_and_metrics_parsing() -> None:
    s = ReplicaSpec.parse("http://h:1/,events=tcp://h:2,replay=tcp://h:3,topic=kv")
    assert (s.url, s.events, s.replay, s.topic) == ("http://h:1", "tcp://h:2", "tcp://h:3", "kv")
    for bad in ("h:1", "http://h:1,evnts=tcp://x:1", "http://h:1,events=h:2", "http://", "http://h:99999",
                "http://h:1,topic=t", "http://h:1,replay=tcp://h:3", "http://h:1,events=tcp://h:2,events=tcp://h:3"):
        with pytest.raises(ValueError, match="replica"):
            ReplicaSpec.parse(bad)
    text = ('# HELP x\nkvpool:num_requests_running{model_name="m"} 2.0\n'
            'kvpool:num_requests_waiting{model_name="m"} 3.0\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert _read_metrics(text) == {"num_requests_running": 2.0, "num_requests_waiting": 3.0,
                                   "kv_cache_usage_perc": 0.25}


def test_router_notices_replicas_hashing_differently() -> None:
    tokens = list(range(16))
    theirs = CacheRequest("x", tokens, hasher=BlockHasher(16, "xxh3_128")).block_hashes[0]
    ours = CacheRequest("x", tokens, hasher=BlockHasher(16)).block_hashes[0]
    r = Router([ReplicaSpec("http://a:1"), ReplicaSpec("http://b:1")], block_size=16)
    for name, h in (("http://a:1", ours), ("http://b:1", theirs)):
        r._on_batch(name, [{**stored([h]), "token_ids": tokens, "block_size": 16}])
    assert r.metrics.hash_mismatch.labels("http://a:1")._value.get() == 0
    assert r.metrics.hash_mismatch.labels("http://b:1")._value.get() == 1


def test_router_hashes_like_the_replicas_including_the_salt() -> None:
    r = Router([ReplicaSpec("http://a:1")], block_size=4)
    toks = list(range(9))
    plain = r.block_hashes(toks, None)
    assert plain == CacheRequest("x", toks, hasher=BlockHasher(4)).block_hashes and len(plain) == 2
    salted = r.block_hashes(toks, "tenant-a")
    assert salted == CacheRequest("x", toks, hasher=BlockHasher(4), cache_salt="tenant-a").block_hashes
    assert salted[0] != plain[0]
    assert r.route_key("/v1/completions", {"prompt": toks, "cache_salt": "s"}) == RouteKey(r.block_hashes(toks, "s"),
                                                                                            servable=2)
    assert r.route_key("/v1/completions", {"prompt": "text"}) == RouteKey([])  # no tokenizer: route by load
    # truncate_prompt_tokens: the prompt the replica runs, its last k tokens (-1: as sent)
    cut = r.route_key("/v1/completions", {"prompt": toks, "truncate_prompt_tokens": 5})
    assert cut == RouteKey(r.block_hashes(toks[-5:], None), servable=1)
    assert r.route_key("/v1/completions", {"prompt": toks, "truncate_prompt_tokens": -1}).hashes == plain


def test_a_prompt_of_whole_blocks_is_matched_on_what_a_replica_serves() -> None:
    """A replica always computes a prompt's last token, so a prompt of exactly 4 blocks hits 3 at most: a
    replica holding all 4 is worth no more than one holding 3, and the less used one gets it."""
    r = Router([ReplicaSpec("http://a:1"), ReplicaSpec("http://b:1")], block_size=4)
    toks = list(range(16))
    key = r.route_key("/v1/completions", {"prompt": toks})
    assert len(key.hashes) == 4 and key.servable == 3
    r.index.apply("http://a:1", [stored(key.hashes)])
    r.index.apply("http://b:1", [stored(key.hashes[:3])])
    r.replicas["http://a:1"].load.kv_usage = 0.5
    assert r.pick(key, set()) == ("http://b:1", 3)
    r.done("http://b:1")
    assert r.pick(key, {"http://b:1"}) == ("http://a:1", 3)
    # One token more: a's fourth block is servable, and worth more than a's fuller cache costs.
    longer = r.route_key("/v1/completions", {"prompt": [*toks, 99]})
    assert longer.servable == 4 and longer.hashes == key.hashes
    r.done("http://a:1")
    assert r.pick(longer, set()) == ("http://a:1", 4)


SYSTEM = "You answer questions about pictures, briefly and truthfully. " * 3


def image_chat(*urls: str, text: str = "What is this?") -> dict[str, Any]:
    parts = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]}


def test_a_chat_with_images_is_also_keyed_by_them(chat_tokenizer: Any) -> None:
    """The router cannot hash images as replicas do (by processed pixels): a chat with images gets `sticky`
    hashes, its text's salted with a digest of its images in order, which its later turns repeat and which
    a chat with the same words and other images does not share."""
    r = Router([ReplicaSpec("http://a:1"), ReplicaSpec("http://b:1")], tokenizer=chat_tokenizer, block_size=4)
    path = "/v1/chat/completions"
    text = r.route_key(path, {"messages": [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": "What is this?"}]})
    one = r.route_key(path, image_chat("data:image/png;base64,AAAA"))
    # Matched against the replicas' events: the blocks of the messages before the first picture only, which a
    # replica tokenizes alike (past it, its tokens hold the picture's); not the same words' without a picture.
    system_ids = chat_tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=True)
    system_ids = system_ids if isinstance(system_ids, list) else system_ids["input_ids"]
    assert len(one.hashes) == len(system_ids) // 4 < len(text.hashes) and text.sticky is None
    assert one.hashes == text.hashes[:len(one.hashes)]
    assert one.sticky is not None and len(one.sticky) == len(text.hashes) and one.sticky[0] != text.hashes[0]
    first_message = r.route_key(path, {"messages": image_chat("data:image/png;base64,AAAA")["messages"][1:]})
    assert first_message.hashes == [] and first_message.sticky
    assert r.route_key(path, image_chat("data:image/png;base64,AAAA")) == one
    assert r.route_key(path, image_chat("data:image/png;base64,AAAB")).sticky != one.sticky
    two = r.route_key(path, image_chat("data:image/png;base64,AAAA", "data:image/png;base64,AAAB"))
    assert two.sticky != one.sticky != r.route_key(path, image_chat("data:image/png;base64,AAAB",
                                                                     "data:image/png;base64,AAAA")).sticky
    # Routed by them: a later request with the same images goes where the first went, past the text.
    first = r.pick(one, set())
    assert first is not None
    r.done(first[0])
    again = r.pick(one, set())
    assert again == (first[0], len(one.sticky))
    r.done(first[0])
    assert r.routed.match(one.sticky, first[0]) == len(one.sticky)
    assert r.pending.match(one.hashes, first[0]) == 0  # the text-only hashes are not remembered for it
    # A replica back from down may have restarted, its caches empty: what was sent there is forgotten.
    r.mark_down(first[0])
    answers = SimpleNamespace(get=lambda url: SimpleNamespace(status_code=200, text="", headers={}))
    r._check(answers, r.replicas[first[0]])  # type: ignore[arg-type]
    assert r.replicas[first[0]].healthy and r.routed.match(one.sticky, first[0]) == 0


def test_router_marks_a_replica_down_after_a_run_of_missed_health_checks() -> None:
    import socket
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    delay = [0.5]

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                time.sleep(delay[0])
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with socket.socket() as s:  # a port nothing listens on: a replica whose process is gone
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}"
    r = Router([ReplicaSpec(url), ReplicaSpec(gone)], block_size=16)
    busy, dead = r.replicas[url], r.replicas[gone]
    try:
        with httpx.Client(timeout=0.1) as client:
            for i in range(r.down_after_missed_checks):
                assert busy.healthy, f"down after {i} missed checks"
                r._check(client, busy)
            assert not busy.healthy  # a run of them: down
            delay[0] = 0.0
            r._check(client, busy)
            assert busy.healthy and busy.missed_checks == 0  # answers again: back at once
            r._check(client, dead)
            assert not dead.healthy  # refused: down at the first check
    finally:
        server.shutdown()


@pytest.mark.parametrize("flag,value,message", [
    ("--max-body-bytes", "-5", "max_body_bytes: must be >= 1, got -5"),
    ("--max-store-blocks", "0", "max_store_blocks: must be >= 1, got 0"),
    ("--policy round-robin --load-weight", "2",
     "load_weight: --policy round-robin does not weigh load; leave the flag out, or route with --policy cache"),
    ("--hash-seed", "", "hash_seed: empty (it would hash as no seed); give a value, or leave it out for none"),
    ("--load-weight", "nan", "load_weight: must be a finite number >= 0, got nan"),
    ("--load-weight", "inf", "load_weight: must be a finite number >= 0, got inf"),
    ("--load-weight", "-3", "load_weight: must be a finite number >= 0, got -3.0"),
])
def test_router_flags_out_of_range_are_clear_errors(flag: str, value: str, message: str,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from kvpool.cli import main
    from kvpool.router import app

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the router started")

    monkeypatch.setattr(app, "load_tokenizer", lambda model, chat_template=None: None)  # (no download)
    monkeypatch.setattr(uvicorn, "run", refuse)
    assert main(["router", "--replica", "http://127.0.0.1:9", *flag.split(), value]) == 2
    assert capsys.readouterr().err == f"kvpool: error: {message}\n"


def test_the_store_bound_reaches_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from kvpool.cli import main
    from kvpool.router import app

    seen: list[Router] = []

    def capture(router: Router, **_: object) -> None:
        seen.append(router)

    monkeypatch.setattr(app, "load_tokenizer", lambda model, chat_template=None: None)
    monkeypatch.setattr(app, "create_app", capture)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    assert main(["router", "--replica", "http://127.0.0.1:9", "--max-store-blocks", "7"]) == 0
    assert seen[0].index.max_store_blocks == 7 and seen[0].beta == 1.0  # (--load-weight's default)
    assert main(["router", "--replica", "http://127.0.0.1:9", "--load-weight", "0.5"]) == 0
    assert seen[1].beta == 0.5


def test_non_finite_gauges_are_not_read() -> None:
    text = ("kvpool:num_requests_running NaN\nkvpool:num_requests_waiting +Inf\nvllm:kv_cache_usage_perc -Inf\n"
            "kvpool:num_requests_waiting 2\n")
    assert _read_metrics(text) == {"num_requests_waiting": 2.0}


def test_a_replica_back_with_the_same_stream_keeps_its_index_and_a_new_one_is_checked_again() -> None:
    """Marked down and back with the same `kvpool-instance`: the same process, caches intact, so its index
    is not rebuilt (a replay buffer that no longer reaches its early batches would forget blocks it still
    holds). Back with another: a new process, maybe hashing otherwise, so everything is rebuilt and its
    first block's hash is checked again."""
    r = Router([ReplicaSpec("http://a:1")], block_size=4)
    name = "http://a:1"
    rep = r.replicas[name]
    resyncs: list[int] = []
    rep.subscriber = SimpleNamespace(resync=lambda: resyncs.append(1), alive=True)  # type: ignore[assignment]

    def health(instance: str) -> SimpleNamespace:
        return SimpleNamespace(get=lambda url: SimpleNamespace(status_code=200, text="",
                                                               headers={"kvpool-instance": instance}))

    r._check(health("A"), rep)  # type: ignore[arg-type]
    hashes = r.block_hashes(list(range(12)), None)
    r.routed.record(name, hashes)
    r._checked_hash.add(name)
    r.mark_down(name)
    r._check(health("A"), rep)  # type: ignore[arg-type]
    assert rep.healthy and resyncs == [] and r.routed.match(hashes, name) == 3 and name in r._checked_hash
    r.mark_down(name)
    r._check(health("B"), rep)  # type: ignore[arg-type]
    assert rep.healthy and resyncs == [1] and r.routed.match(hashes, name) == 0 and name not in r._checked_hash


def test_health_tells_the_replicas_only_with_the_key() -> None:
    from fastapi.testclient import TestClient

    from kvpool.router.app import create_app

    client = TestClient(create_app(Router([ReplicaSpec("http://127.0.0.1:9")], block_size=16), api_key="k"))
    assert client.get("/health").json() == {"status": "ok"}
    full = client.get("/health", headers={"Authorization": "Bearer k"}).json()
    assert list(full["replicas"]) == ["http://127.0.0.1:9"]


def test_a_chat_is_keyed_with_its_template_options(chat_tokenizer: Any) -> None:
    """A chat continuing its last message, or without the assistant's turn opened, is keyed by the tokens its
    replica runs (the same renderer), not by the default rendering."""
    r = Router([ReplicaSpec("http://a:1")], tokenizer=chat_tokenizer, block_size=4)
    path = "/v1/chat/completions"
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there, my friend"}]

    def ids(**kw: Any) -> list[int]:
        out = chat_tokenizer.apply_chat_template(msgs, tokenize=True, **kw)
        return out if isinstance(out, list) else out["input_ids"]

    cont = r.route_key(path, {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})
    assert cont.hashes == r.block_hashes(ids(add_generation_prompt=False, continue_final_message=True), None)
    opened = r.route_key(path, {"messages": msgs})
    assert opened.hashes == r.block_hashes(ids(add_generation_prompt=True), None) != cont.hashes
    # Options that contradict: the replica refuses them; routed by load.
    assert r.route_key(path, {"messages": msgs, "continue_final_message": True}) == RouteKey([])


def test_the_router_renders_the_replicas_template_and_never_a_requests_own(chat_llama_dir: Path) -> None:
    """`--chat-template` (the replicas' own, for a model without one) keys chats as the replicas render them;
    a request's own template is Jinja from a client, which the router does not run: that chat goes by load."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    from kvpool.router import app

    tok = app.load_tokenizer(str(chat_llama_dir), template)
    assert tok.chat_template == template
    r = Router([ReplicaSpec("http://a:1")], tokenizer=tok, block_size=4)
    chat = {"messages": [{"role": "user", "content": "Name three colours, then three more."}]}
    ids = tok.encode("<user>Name three colours, then three more.", add_special_tokens=False)
    assert len(r.route_key("/v1/chat/completions", chat).hashes) == len(ids) // 4 > 0
    own = r.route_key("/v1/chat/completions", {**chat, "chat_template": "{{ messages[0]['content'] }}"})
    assert own.hashes == [] and own.sticky is None
    # With an image too (once an assertion, a 500 to the client).
    pictured = image_chat("data:image/png;base64,AAAA")
    own = r.route_key("/v1/chat/completions", {**pictured, "chat_template": "{{ messages[0]['content'] }}"})
    assert own.hashes == [] and own.sticky is None
