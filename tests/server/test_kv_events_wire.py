"""kvpool's KV event stream in vLLM's wire format.

- always: the msgpack shape field by field (what vLLM's msgspec classes require), and the replay socket
  over real ZeroMQ;
- with the vLLM 0.33 peer venv (`../shared/peers/vllm/setup.sh`, default /tmp/vllm-peer-venv, or
  KVPOOL_VLLM_VENV): a real kvpool server's stream, fetched through the replay socket and decoded by vLLM's
  own `KVEventBatch` in that venv. Skipped where the venv is absent (CI machines may not have it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from server_helpers import BLOCK, make_engine

from kvpool.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.core.hashing import BlockHasher
from kvpool.core.request import CacheRequest
from kvpool.server.kv_events import END_SEQ, KVEventPublisher, decode_batch, encode_batch, end_marker_info
from kvpool.server.serve import start_server

VENV = Path(os.environ.get("KVPOOL_VLLM_VENV", "/tmp/vllm-peer-venv"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_batch_shape_is_vllms() -> None:
    events = [BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                          lora_id="adapter-a", extra_keys=(("lora", "adapter-a"), ("salt", "s"))),
              BlockStored(block_hashes=[b"h3"], parent_block_hash=b"h2", token_ids=[5, 6], block_size=2,
                          medium="host", group_id=1),
              BlockRemoved(block_hashes=[b"h1"], medium="host"),
              AllBlocksCleared()]
    raw = msgpack.unpackb(encode_batch(events, ts=12.5), raw=False)
    assert raw[0] == 12.5 and raw[2] == 0 and len(raw) == 3  # array_like EventBatch: [ts, events, rank]
    s1, s2, rm, clr = raw[1]
    assert s1 == {"type": "BlockStored", "block_hashes": [b"h1", b"h2"], "parent_block_hash": None,
                  "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
                  "lora_name": "adapter-a", "extra_keys": [["adapter-a", "s"], ["adapter-a", "s"]], "group_idx": 0}
    assert s2["medium"] == "CPU" and s2["group_idx"] == 1 and s2["parent_block_hash"] == b"h2"
    assert "extra_keys" not in s2  # omitted at its default, as msgspec's omit_defaults does
    assert rm == {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "CPU", "group_idx": 0}
    assert clr == {"type": "AllBlocksCleared"}
    assert isinstance(raw[1][0]["block_hashes"][0], bytes)  # bin, not str: vLLM's hashes are bytes
    _, evs = decode_batch(encode_batch(events))
    assert [e["type"] for e in evs] == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    with pytest.raises(ValueError, match="payload"):
        decode_batch(b"\x93\x01")
    with pytest.raises(ValueError, match="payload: the batch's timestamp is not a number: None"):
        decode_batch(msgpack.packb([None, [], None]))


def test_replay_socket_resends_from_a_sequence_number() -> None:
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(pub_ep, topic="t", replay_endpoint=replay_ep)
    pub.bind()
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)  # many replies to one request: REQ would allow one
    req.setsockopt(zmq.RCVTIMEO, 5000)
    req.connect(replay_ep)
    try:
        for i in range(5):
            pub.publish([BlockStored(block_hashes=[bytes([i])], parent_block_hash=None, token_ids=[i], block_size=1)])
        time.sleep(0.2)
        req.send_multipart([b"", (2).to_bytes(8, "big")])  # REQ's envelope
        got = []
        while True:
            _, topic, seq, payload = req.recv_multipart()
            if seq == END_SEQ:  # its payload tells the publisher's id (per start) and its next number
                assert topic == b"" and end_marker_info(payload) == (pub.instance, 5)
                break
            assert topic == b"t"
            got.append((int.from_bytes(seq, "big"), decode_batch(payload)[1][0]["block_hashes"][0]))
        assert got == [(2, b"\x02"), (3, b"\x03"), (4, b"\x04")]
    finally:
        req.close(0)
        ctx.term()
        pub.close()


def test_a_bad_replay_endpoint_is_named_as_such() -> None:
    """Each endpoint is its own flag: a replay endpoint ZeroMQ refuses is not reported as the PUB one."""
    pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint="bogus-endpoint")
    with pytest.raises(ValueError, match=r"^kv_events_replay_endpoint: cannot bind"):
        pub.bind()
    with pytest.raises(ValueError, match=r"^kv_events_endpoint: cannot bind"):
        KVEventPublisher("bogus-endpoint", replay_endpoint=f"tcp://127.0.0.1:{free_port()}").bind()


def vllm_decoded(replay_ep: str) -> list[dict]:
    """Every batch a replica's replay socket holds, decoded by vLLM 0.33's own classes in the peer venv
    (vllm_decode_events.py): one dict per batch."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(VENV / "bin" / "python"), str(Path(__file__).with_name("vllm_decode_events.py")),
                           replay_ep], capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                    reason=f"no vLLM peer venv at {VENV} (build it with ../shared/peers/vllm/setup.sh; CI may lack it)")
def test_vllm_decodes_kvpool_stream(chat_llama_dir: Path) -> None:
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    h = start_server(make_engine(chat_llama_dir, enable_kv_events=True, num_blocks=12), served_model_name="tiny",
                     kv_events_endpoint=pub_ep, kv_events_replay_endpoint=replay_ep)
    try:
        prompts = [list(range(100, 100 + 3 * BLOCK + 5)), list(range(500, 500 + 8 * BLOCK + 1))]
        for p in prompts:  # the second one evicts blocks of the first (11 usable blocks)
            assert httpx.post(f"{h.url}/v1/completions", json={"prompt": p, "max_tokens": 2}).status_code == 200
        assert h.engine.call_soon(lambda e: e.kv.reset_prefix_cache()).result(10)
        assert httpx.post(f"{h.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200
        time.sleep(0.3)
        batches = vllm_decoded(replay_ep)
    finally:
        h.stop()
    assert [b["seq"] for b in batches] == list(range(len(batches)))
    assert all(b["topic"] == "kv-events" and b["rank"] == 0 for b in batches)
    events = [e for b in batches for e in b["events"]]
    stored = [x for e in events if e["type"] == "BlockStored" for x in e["hashes"]]
    hasher = BlockHasher(BLOCK)
    for p in prompts:
        want = [x.hex() for x in CacheRequest("ref", p, hasher=hasher).block_hashes]
        assert [x for x in stored if x in want] == want  # every full block, in chain order
    first = next(e for e in events if e["type"] == "BlockStored")
    assert first["parent"] is None and first["tokens"][:BLOCK] == prompts[0][:BLOCK] and first["medium"] == "GPU"
    assert any(e["type"] == "BlockRemoved" for e in events), "11 blocks cannot hold both prompts"
    assert events[-1]["type"] in ("AllBlocksCleared", "BlockStored") and any(
        e["type"] == "AllBlocksCleared" for e in events)
    # vLLM's decoder accepted every payload; the block size and hashes came through as sent.
    assert all(e["block_size"] == BLOCK for e in events if e["type"] == "BlockStored")


@pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                    reason=f"no vLLM peer venv at {VENV} (build it with ../shared/peers/vllm/setup.sh; CI may lack it)")
def test_vllm_decodes_the_host_and_store_tiers_events(chat_llama_dir: Path, tmp_path: Path) -> None:
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    h = start_server(make_engine(chat_llama_dir, enable_kv_events=True, num_blocks=12, num_host_blocks=16,
                                 write_through=True, kv_store=f"file://{tmp_path}"),
                     served_model_name="tiny", kv_events_endpoint=pub_ep, kv_events_replay_endpoint=replay_ep)
    prompt = list(range(100, 100 + 3 * BLOCK + 5))
    try:
        assert httpx.post(f"{h.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
        time.sleep(0.5)  # the store's writes land and the idle engine publishes them
        batches = vllm_decoded(replay_ep)
    finally:
        h.stop()
    events = [e for b in batches for e in b["events"]]
    want = [x.hex() for x in CacheRequest("ref", prompt, hasher=BlockHasher(BLOCK)).block_hashes]
    for medium in ("GPU", "CPU", "STORAGE"):  # device, host (write-through), then the store
        got = [x for e in events if e["type"] == "BlockStored" and e["medium"] == medium for x in e["hashes"]]
        assert got == want, medium
    tokens = [t for e in events if e["type"] == "BlockStored" and e["medium"] == "STORAGE" for t in e["tokens"]]
    assert tokens == prompt[:3 * BLOCK]


def test_a_replay_endpoint_without_an_events_endpoint_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """It was ignored silently (no events are published to replay); now refused before the model loads, by
    `kvpool serve` and by `build`, naming both flags."""
    from types import SimpleNamespace

    import kvpool.server.serve as serve_mod
    from kvpool.cli import main

    def no_engine(**_: object) -> None:
        raise AssertionError("the engine was built before the flags were checked")

    monkeypatch.setattr(serve_mod, "LLMEngine", no_engine)
    assert main(["serve", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}"]) == 2
    err = capsys.readouterr().err
    assert "kvpool: error: kv_events_replay_endpoint: --kv-events-replay-endpoint needs --kv-events-endpoint" in err
    engine = SimpleNamespace(model_dir=Path("m"), list_loras=lambda: [])
    with pytest.raises(ValueError, match=r"^kv_events_replay_endpoint: .* needs --kv-events-endpoint"):
        serve_mod.build(engine, kv_events_replay_endpoint="tcp://127.0.0.1:1")  # type: ignore[arg-type]
    # A topic alike: it names what is published.
    assert main(["serve", "--kv-events-topic", "mine"]) == 2
    assert "kvpool: error: kv_events_topic: --kv-events-topic needs --kv-events-endpoint" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^kv_events_topic: .* needs --kv-events-endpoint"):
        serve_mod.build(engine, kv_events_topic="mine")  # type: ignore[arg-type]
