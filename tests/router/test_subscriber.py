"""The router's event subscriber over real ZeroMQ: it catches up through the replay socket, applies live
batches once each, and forgets a replica's blocks when its stream restarts (the replica restarted: its
tiers are empty)."""

from __future__ import annotations

import time

from replicas import free_port

from kvpool.core.events import BlockStored
from kvpool.router.index import PrefixIndex
from kvpool.router.subscriber import EventSubscriber
from kvpool.server.kv_events import KVEventPublisher


def stored(h: bytes) -> list:
    return [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[1], block_size=1)]


def wait_for(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_catch_up_live_and_restart() -> None:
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(pub_ep, replay_endpoint=replay_ep)
    pub.bind()
    for i in range(3):
        pub.publish(stored(bytes([i])))
    time.sleep(0.2)
    ix = PrefixIndex()
    sub = EventSubscriber("r", pub_ep, ix, replay_endpoint=replay_ep).start()
    try:
        wait_for(lambda: ix.num_blocks("r") == 3)  # learned through the replay
        time.sleep(0.3)  # the SUB connection is up
        pub.publish(stored(b"\x09"))
        wait_for(lambda: ix.num_blocks("r") == 4)
        assert sub.batches == 4 and sub.restarts == 0
        # The replica restarts: a new publisher on the same endpoints, numbering from 0 again.
        pub.close()
        pub = KVEventPublisher(pub_ep, replay_endpoint=replay_ep)
        pub.bind()
        time.sleep(0.5)
        pub.publish(stored(b"\x20"))
        wait_for(lambda: sub.restarts == 1)
        wait_for(lambda: ix.num_blocks("r") == 1)
        assert ix.match([b"\x20"], ["r"])["r"][0] == 1 and ix.match([b"\x00"], ["r"])["r"][0] == 0
    finally:
        sub.stop()
        pub.close()
