"""Run with the vLLM peer venv's python: asks a kvpool replica's replay socket for every batch from
sequence 0, decodes each payload with vLLM's own `KVEventBatch` (msgspec, strict types), and prints one
JSON line per batch. Usage: python vllm_decode_events.py REPLAY_ENDPOINT"""

import json
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

ctx = zmq.Context()
req = ctx.socket(zmq.DEALER)  # many replies to one request: REQ would allow one
req.setsockopt(zmq.RCVTIMEO, 10_000)
req.connect(sys.argv[1])
req.send_multipart([b"", (0).to_bytes(8, "big")])  # REQ's envelope
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
while True:
    _, topic, seq, payload = req.recv_multipart()
    if int.from_bytes(seq, "big", signed=True) == -1:
        break
    batch = dec.decode(payload)
    out = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            out.append({"type": "BlockStored", "hashes": [h.hex() for h in e.block_hashes],
                        "parent": e.parent_block_hash.hex() if e.parent_block_hash else None,
                        "tokens": e.token_ids, "block_size": e.block_size, "medium": e.medium,
                        "group_idx": e.group_idx})
        elif isinstance(e, BlockRemoved):
            out.append({"type": "BlockRemoved", "hashes": [h.hex() for h in e.block_hashes], "medium": e.medium})
        else:
            assert isinstance(e, AllBlocksCleared)
            out.append({"type": "AllBlocksCleared"})
    print(json.dumps({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "ts": batch.ts,
                      "rank": batch.data_parallel_rank, "events": out}))
