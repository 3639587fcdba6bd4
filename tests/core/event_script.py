"""Drive a KV cache manager (kvpool's, or vLLM's from its own venv) through one scripted request
sequence and print the KV events it emitted, normalized so the two can be compared.

Usable as a module (kvpool's side, in the test process) and as a script (`python event_script.py
vllm`, run by the vLLM peer venv's interpreter: it imports nothing of kvpool). Hash bytes differ by
design between the two, so each distinct hash is replaced by the order of its first appearance in the
stream; everything else (event types, counts, parents, tokens, block size, medium, group) must match.
"""

from __future__ import annotations

import json
import sys
from typing import Any

BLOCK_SIZE = 4
NUM_BLOCKS = 10  # 9 usable: small enough that the script evicts

# (op, request id, tokens or token): admissions look up and allocate the whole prompt, decodes append
# one token and allocate its slot, frees release a request, reset forgets every cached hash.
SCRIPT: list[list[Any]] = [
    ["admit", "a", list(range(10))],          # 2 full blocks cached (+ a partial)
    ["decode", "a", 10], ["decode", "a", 11],  # block 3 fills at 12 tokens: stored with its parent
    ["admit", "b", [*range(8), 50, 51]],       # hits a's 2 blocks, caches nothing new yet
    ["admit", "c", list(range(10))],           # hits a's 2 blocks too
    ["free", "a"], ["free", "b"], ["free", "c"],
    ["admit", "d", list(range(100, 126))],     # 7 blocks: evicts cached ones (removed events)
    ["admit", "e", list(range(8))],            # 8 tokens: only block 0 can hit (last token recomputed)
    ["free", "d"], ["free", "e"],
    ["admit", "f", list(range(200, 208))],     # the same 8-token prompt twice: g hits f's first block
    ["admit", "g", list(range(200, 208))],     # only and caches a duplicate copy of f's second block
    ["free", "f"], ["free", "g"],
    ["admit", "i", list(range(400, 432))],     # 8 blocks: evicts every cached block, both copies included
    ["free", "i"],
    ["reset"],
    ["admit", "h", list(range(300, 309))],
    ["free", "h"],
]


def normalize(events: list[tuple[str, dict[str, Any]]]) -> list[list[Any]]:
    ids: dict[Any, int] = {}

    def h(x: Any) -> int | None:
        if x is None:
            return None
        return ids.setdefault(x, len(ids))

    out = []
    for kind, e in events:
        if kind == "BlockStored":
            out.append([kind, [h(x) for x in e["block_hashes"]], h(e["parent_block_hash"]), list(e["token_ids"]),
                        e["block_size"], e["medium"], e["group"]])
        elif kind == "BlockRemoved":
            out.append([kind, [h(x) for x in e["block_hashes"]], e["medium"], e["group"]])
        else:
            out.append([kind])
    return out


def run_kvpool() -> list[list[Any]]:
    from kvpool.core.events import BlockRemoved, BlockStored
    from kvpool.core.hashing import BlockHasher
    from kvpool.core.kv_cache_manager import KVCacheManager
    from kvpool.core.request import CacheRequest

    mgr = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_kv_events=True)
    hasher = BlockHasher(BLOCK_SIZE)
    reqs: dict[str, CacheRequest] = {}
    events: list[tuple[str, dict[str, Any]]] = []

    def take() -> None:
        for e in mgr.take_events():
            if isinstance(e, BlockStored):
                events.append(("BlockStored", dict(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                                                   token_ids=e.token_ids, block_size=e.block_size, medium=e.medium,
                                                   group=e.group_id)))
            elif isinstance(e, BlockRemoved):
                events.append(("BlockRemoved", dict(block_hashes=e.block_hashes, medium=e.medium, group=e.group_id)))
            else:
                events.append(("AllBlocksCleared", {}))

    for op in SCRIPT:
        if op[0] == "admit":
            req = reqs[op[1]] = CacheRequest(op[1], op[2], hasher=hasher)
            hit, n = mgr.get_computed_blocks(req)
            assert mgr.allocate_slots(req, req.num_tokens - n, n, hit) is not None, op
            req.num_computed_tokens = req.num_tokens
        elif op[0] == "decode":
            req = reqs[op[1]]
            req.append_output_token_ids(op[2])
            assert mgr.allocate_slots(req, 1) is not None, op
            req.num_computed_tokens += 1
        elif op[0] == "free":
            mgr.free(reqs.pop(op[1]))
        else:
            assert mgr.reset_prefix_cache()
        take()
    return normalize(events)


def run_vllm() -> list[list[Any]]:  # pragma: no cover - runs in the vLLM peer venv
    import torch
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)])
    mgr = KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
                         enable_caching=True, enable_kv_cache_events=True)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    sp = SamplingParams(max_tokens=1024)
    reqs: dict[str, Any] = {}
    events: list[tuple[str, dict[str, Any]]] = []

    def take() -> None:
        for e in mgr.take_events():
            if isinstance(e, BlockStored):
                events.append(("BlockStored", dict(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                                                   token_ids=e.token_ids, block_size=e.block_size, medium=e.medium,
                                                   group=e.group_idx or 0)))
            elif isinstance(e, BlockRemoved):
                events.append(("BlockRemoved", dict(block_hashes=e.block_hashes, medium=e.medium,
                                                    group=e.group_idx or 0)))
            elif isinstance(e, AllBlocksCleared):
                events.append(("AllBlocksCleared", {}))

    for op in SCRIPT:
        if op[0] == "admit":
            req = reqs[op[1]] = Request(request_id=op[1], prompt_token_ids=op[2], sampling_params=sp,
                                        pooling_params=None, block_hasher=hasher)
            blocks, n, _ = mgr.get_computed_blocks(req)
            assert mgr.allocate_slots(req, len(op[2]) - n, num_new_computed_tokens=n, new_computed_blocks=blocks,
                                      full_sequence_must_fit=True) is not None, op
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = len(op[2])
        elif op[0] == "decode":
            req = reqs[op[1]]
            req.append_output_token_ids(op[2])
            assert mgr.allocate_slots(req, 1) is not None, op
            req.num_computed_tokens += 1
        elif op[0] == "free":
            mgr.free(reqs.pop(op[1]))
        else:
            assert mgr.reset_prefix_cache()
        take()
    return normalize(events)


if __name__ == "__main__":
    print(json.dumps(run_vllm() if sys.argv[1:] == ["vllm"] else run_kvpool()))
