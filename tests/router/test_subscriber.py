"""The router's event subscriber over real ZeroMQ: it catches up through the replay socket, applies live
batches once each, and forgets a replica's blocks when its stream restarts (the replica restarted: its
tiers are empty); a replay that no longer reaches back to batch 0 is applied anyway; a batch it cannot use
is skipped like a lost one, and the thread goes on; an endpoint ZeroMQ refuses fails at start-up."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import zmq
from replicas import free_port

from kvpool.core.events import BlockStored
from kvpool.router.app import ReplicaSpec, Router
from kvpool.router.index import PrefixIndex
from kvpool.router.subscriber import EventSubscriber
from kvpool.server.kv_events import KVEventPublisher, encode_batch


def stored(h: bytes) -> list:
    return [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[1], block_size=1)]


def wait_for(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def publisher(**kw: Any) -> tuple[KVEventPublisher, str, str]:
    """A bound publisher with a replay socket on free loopback ports: it, its endpoint, its replay endpoint."""
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(pub_ep, replay_endpoint=replay_ep, **kw)
    pub.bind()
    return pub, pub_ep, replay_ep


def caught_up() -> tuple[KVEventPublisher, PrefixIndex, EventSubscriber]:
    """A replica that published batches 0..2, and a router started after them that learned them by replay."""
    pub, pub_ep, replay_ep = publisher()
    for i in range(3):
        pub.publish(stored(bytes([i])))
    time.sleep(0.2)
    ix = PrefixIndex()
    sub = EventSubscriber("r", pub_ep, ix, replay_endpoint=replay_ep).start()
    try:
        wait_for(lambda: ix.num_blocks("r") == 3 and sub.next_seq == 3)
    except BaseException:
        sub.stop()
        pub.close()
        raise
    return pub, ix, sub


def restarted(pub: KVEventPublisher) -> KVEventPublisher:
    """The replica restarts: a new publisher on the same endpoints (numbering from 0 again, a new id)."""
    pub.close()
    new = KVEventPublisher(pub.endpoint, replay_endpoint=pub.replay_endpoint)
    new.bind()
    return new


def test_catch_up_live_and_restart() -> None:
    pub, ix, sub = caught_up()
    try:
        time.sleep(0.3)  # the SUB connection is up
        pub.publish(stored(b"\x09"))
        wait_for(lambda: ix.num_blocks("r") == 4)
        assert sub.batches == 4 and sub.restarts == 0
        pub = restarted(pub)
        time.sleep(0.5)
        pub.publish(stored(b"\x20"))
        wait_for(lambda: sub.restarts == 1)
        wait_for(lambda: ix.num_blocks("r") == 1)
        assert ix.match([b"\x20"], ["r"])["r"][0] == 1 and ix.match([b"\x00"], ["r"])["r"][0] == 0
    finally:
        sub.stop()
        pub.close()


def caught_up_then_restarted() -> tuple[KVEventPublisher, PrefixIndex, EventSubscriber]:
    """A router that caught up by replay on batches 0..2 (next 3), then its replica restarted."""
    pub, ix, sub = caught_up()
    return restarted(pub), ix, sub


def test_a_restart_before_any_live_batch_is_seen() -> None:
    """The router caught up by replay (next batch 3) and the replica restarted before sending a live batch:
    the new stream's batches 0 and 1 are below 3, yet they are not the replayed ones. The replay's end
    marker tells the publisher's id, which changed, so the old blocks go and the new ones are indexed."""
    pub, ix, sub = caught_up_then_restarted()
    try:
        time.sleep(0.7)  # the SUB connection is up again
        pub.publish(stored(b"\x20"))
        pub.publish(stored(b"\x21"))
        wait_for(lambda: sub.restarts == 1 and ix.num_blocks("r") == 2)
        assert ix.match([b"\x20", b"\x21"], ["r"])["r"][0] == 2 and ix.match([b"\x00"], ["r"])["r"][0] == 0
        time.sleep(0.2)
        assert sub.restarts == 1 and sub.next_seq == 2
    finally:
        sub.stop()
        pub.close()


def test_a_restart_seen_only_as_a_gap_is_a_restart() -> None:
    """The restarted replica published batches 0..4 before the router's SUB connected again (they are lost),
    then batch 5: a gap after 3, not a step back. The gap's replay comes from another publisher id, so the
    index is rebuilt from the new replica's batches alone, not patched onto the old one's."""
    pub, ix, sub = caught_up_then_restarted()
    try:
        for i in range(5):  # at once: the SUB has not reconnected yet, so PUB drops them
            pub.publish(stored(bytes([0x20 + i])))
        time.sleep(0.7)
        pub.publish(stored(b"\x25"))
        wait_for(lambda: sub.restarts == 1 and ix.num_blocks("r") == 6)
        assert ix.match([bytes([0x20 + i]) for i in range(6)], ["r"])["r"][0] == 6
        assert all(ix.match([bytes([i])], ["r"])["r"][0] == 0 for i in range(3))
    finally:
        sub.stop()
        pub.close()


def test_a_live_batch_the_replay_gave_is_dropped_once_the_id_matches() -> None:
    """Live batches below the replayed number, before any other live batch, from the same publisher: the
    start-up race (the SUB was connected while the replay ran). They are dropped, not counted as a restart.
    (Driven on the test's thread, without `start`: the race cannot be timed over a real socket.)"""
    pub, pub_ep, replay_ep = publisher()
    for i in range(3):
        pub.publish(stored(bytes([i])))
    time.sleep(0.2)
    ix = PrefixIndex()
    sub = EventSubscriber("r", pub_ep, ix, replay_endpoint=replay_ep)
    try:
        assert sub._replay(0) and sub.next_seq == 3 and ix.num_blocks("r") == 3
        sub._receive([b"kv-events", (1).to_bytes(8, "big"), encode_batch(stored(b"\x01"))])
        sub._receive([b"kv-events", (2).to_bytes(8, "big"), encode_batch(stored(b"\x02"))])
        assert sub.restarts == 0 and sub.batches == 3 and sub.next_seq == 3 and ix.num_blocks("r") == 3
    finally:
        sub.stop()
        pub.close()


def test_a_replay_that_starts_later_than_asked_is_still_applied() -> None:
    """A router started once the replica's replay buffer has moved past batch 0 learns what the buffer
    holds (a subset of what the replica caches: what was stored before it stays unknown)."""
    pub, pub_ep, replay_ep = publisher(buffer_steps=10)
    for i in range(30):
        pub.publish(stored(bytes([i])))
    time.sleep(0.2)
    ix = PrefixIndex()
    sub = EventSubscriber("r", pub_ep, ix, replay_endpoint=replay_ep).start()
    try:
        wait_for(lambda: ix.num_blocks("r") == 10)  # batches 20..29
        assert sub.next_seq == 30
        assert ix.match([bytes([20])], ["r"])["r"][0] == 1 and ix.match([bytes([19])], ["r"])["r"][0] == 0
        time.sleep(0.3)  # the SUB connection is up
        pub.publish(stored(b"\x40"))
        wait_for(lambda: ix.num_blocks("r") == 11)
        assert sub.gaps == 0 and sub.decode_errors == 0
    finally:
        sub.stop()
        pub.close()


def raw_batch(ts: object, events: list[dict]) -> bytes:
    return msgpack.packb([ts, events, 0], use_bin_type=True)


def stored_dict(hashes: object, tokens: int = 1) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": list(range(tokens)), "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}


# (batch, whether the router can use it): a batch it cannot use counts as an error and, since it may have
# removed blocks, drops the replica's entries, as a lost batch would.
BATCHES = {
    "timestamp null": (raw_batch(None, [stored_dict([b"\x02"])]), False),
    "hash a str": (raw_batch(1.0, [stored_dict(["ab"])]), False),
    "hash a float": (raw_batch(1.0, [stored_dict([1.5])]), False),
    "removed hashes null": (raw_batch(1.0, [{"type": "BlockRemoved", "block_hashes": None, "medium": "GPU"}]), False),
    "not msgpack": (b"\xc1garbage", False),
    "stored, no hashes": (raw_batch(1.0, [stored_dict([], tokens=16)]), True),  # (the router's hash check)
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_a_bad_batch_does_not_stop_the_subscriber(name: str) -> None:
    payload, usable = BATCHES[name]
    ep = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(ep)
    router = Router([ReplicaSpec("http://127.0.0.1:9", events=ep)], block_size=16, health_interval_s=60)
    router.start()
    seq = iter(range(100))

    def send(p: bytes) -> None:
        pub.send_multipart([b"", next(seq).to_bytes(8, "big"), p])

    try:
        rep = router.replicas["http://127.0.0.1:9"]
        time.sleep(0.3)  # the SUB connection is up
        send(raw_batch(1.0, [stored_dict([b"\x01"])]))
        wait_for(lambda: router.index.num_blocks(rep.name) == 1)
        send(payload)
        send(raw_batch(1.0, [stored_dict([b"\x03"])]))
        wait_for(lambda: router.index.match([b"\x03"], [rep.name])[rep.name][0] == 1)
        send(raw_batch(1.0, [stored_dict([b"\x04"])]))
        wait_for(lambda: router.index.match([b"\x04"], [rep.name])[rep.name][0] == 1)
        state = router.snapshot()[rep.name]
        assert state["events_alive"] is True
        assert state["event_batch_errors"] == (0 if usable else 1)
        assert router.index.num_blocks(rep.name) == (3 if usable else 2)  # b"\x01" is forgotten after a bad one
        assert rep.subscriber is not None and rep.subscriber.gaps == 0
    finally:
        router.stop()
        pub.close(0)
        ctx.term()
    assert router.snapshot()["http://127.0.0.1:9"]["events_alive"] is False


def test_an_events_endpoint_zeromq_refuses_fails_at_start_up() -> None:
    bad = "tcp://127.0.0.1:notaport"
    with pytest.raises(ValueError, match=r"replica: events='tcp://127.0.0.1:notaport' of http://h:1"):
        EventSubscriber("http://h:1", bad, PrefixIndex()).start()
    good = f"tcp://127.0.0.1:{free_port()}"
    router = Router([ReplicaSpec("http://h:1", events=good), ReplicaSpec("http://h:2", events=good, replay=bad)])
    with pytest.raises(ValueError, match=r"replica: replay='tcp://127.0.0.1:notaport' of http://h:2"):
        router.start()
    assert router.replicas["http://h:1"].subscriber is not None
    assert not router.replicas["http://h:1"].subscriber.alive  # stopped again
