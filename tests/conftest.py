"""Shared test helpers: word-level 'tokenizers' for the seeds' examples and manager shortcuts."""

from __future__ import annotations

import pytest

from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvpool.core.request import CacheRequest


class Words:
    """Maps each distinct word to a stable token id, so the seeds' sentences become token lists."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        return [self.ids.setdefault(w, len(self.ids) + 100) for w in text.split()]


@pytest.fixture
def words() -> Words:
    return Words()


def schedule(mgr: KVCacheManager, req: CacheRequest) -> KVCacheBlocks | None:
    """What the scheduler does to admit a request: lookup, then allocate the whole prompt."""
    hit, n_hit = mgr.get_computed_blocks(req)
    out = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit)
    if out is not None:
        req.num_computed_tokens = req.num_tokens
    return out


def decode(mgr: KVCacheManager, req: CacheRequest, token: int) -> KVCacheBlocks | None:
    """One decode step: append the sampled token, then make room for it."""
    req.append_output_token_ids(token)
    out = mgr.allocate_slots(req, 1)
    if out is not None:
        req.num_computed_tokens += 1
    return out


def make_request(rid: str, tokens: list[int], block_size: int, **kw: object) -> CacheRequest:
    return CacheRequest(rid, tokens, hasher=BlockHasher(block_size), **kw)  # type: ignore[arg-type]
