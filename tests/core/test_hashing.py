from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool.core.hashing import BlockHasher
from kvpool.core.request import CacheRequest, MultiModalItem

TOKENS = list(range(3000, 3000 + 40))

_SCRIPT = """
import sys
from kvpool.core.hashing import BlockHasher
from kvpool.core.request import CacheRequest, MultiModalItem
h = BlockHasher(16, sys.argv[1], seed=sys.argv[2] or None)
r = CacheRequest("x", list(range(3000, 3040)), hasher=h, lora_id="adapter-a", cache_salt="tenant",
                 mm_items=[MultiModalItem("img", 10, 12)])
print(",".join(x.hex() for x in r.block_hashes))
"""


def hashes(algo: str = "sha256", seed: str | None = None, **kw: object) -> list[bytes]:
    return CacheRequest("x", TOKENS, hasher=BlockHasher(16, algo, seed), **kw).block_hashes  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
def test_hashes_are_identical_across_processes(algo: str) -> None:
    expected = ",".join(x.hex() for x in hashes(algo, lora_id="adapter-a", cache_salt="tenant",
                                                 mm_items=[MultiModalItem("img", 10, 12)]))
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _SCRIPT, algo, ""], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        outs.add(out)
    assert outs == {expected}


def test_known_value_pins_the_encoding() -> None:
    # A change of the byte encoding breaks routers and other replicas: it must be deliberate.
    h = BlockHasher(4)
    r = CacheRequest("x", [1, 2, 3, 4], hasher=h)
    import hashlib
    root = hashlib.sha256(b"kvpool/block-hash/v1" + b"\x00\x00\x00\x00").digest()
    assert h.root_hash == root
    assert r.block_hashes == [hashlib.sha256(root + bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0]))
                              .digest()]


def test_algorithms_and_lengths() -> None:
    sha, xxh = hashes("sha256"), hashes("xxh3_128")
    assert len(sha) == len(xxh) == 2  # 40 tokens: two full blocks of 16, the partial one is not hashed
    assert {len(x) for x in sha} == {32} and {len(x) for x in xxh} == {16}
    assert hashes("xxhash") == xxh
    with pytest.raises(ValueError, match="hash_algo"):
        BlockHasher(16, "md5")


def test_secret_seed_changes_every_hash_deterministically() -> None:
    plain, seeded = hashes(), hashes(seed="s3cret")
    assert not set(plain) & set(seeded)
    assert hashes(seed="s3cret") == seeded


def test_chain_depends_on_parent() -> None:
    a = CacheRequest("a", TOKENS, hasher=BlockHasher(16)).block_hashes
    b = CacheRequest("b", [9, *TOKENS[1:]], hasher=BlockHasher(16)).block_hashes
    assert a[0] != b[0] and a[1] != b[1]  # same tokens in block 1, different parent


def test_salt_separates_and_only_enters_the_first_block() -> None:
    base = hashes()
    s1, s2 = hashes(cache_salt="tenant-1"), hashes(cache_salt="tenant-2")
    assert s1[0] != base[0] and s1[0] != s2[0]
    h = BlockHasher(16)
    r = CacheRequest("r", TOKENS, hasher=h, cache_salt="tenant-1")
    # Block 1's own bytes carry no salt: it differs only through its parent.
    assert r.block_hashes[1] == h.hash_block(r.block_hashes[0], bytes(
        __import__("array").array("I", TOKENS[16:32]).tobytes()))


def test_lora_separates() -> None:
    assert hashes(lora_id=1)[0] != hashes()[0]
    assert hashes(lora_id=1)[0] != hashes(lora_id=2)[0]
    assert hashes(lora_id=1)[0] != hashes(lora_id="1")[0]


def test_multimodal_hash_and_offset_separate() -> None:
    base = hashes(mm_items=[MultiModalItem("img-a", 4, 8)])
    other_image = hashes(mm_items=[MultiModalItem("img-b", 4, 8)])
    other_offset = hashes(mm_items=[MultiModalItem("img-a", 5, 8)])
    assert base[0] != other_image[0] and base[0] != other_offset[0]
    # An item in block 1 only leaves block 0 as if there were no item.
    late = hashes(mm_items=[MultiModalItem("img-a", 20, 4)])
    assert late[0] == hashes()[0] and late[1] != hashes()[1]
    # An item straddling a boundary enters both blocks, with its offset relative to each block.
    h = BlockHasher(16)
    r = CacheRequest("r", TOKENS, hasher=h, mm_items=[MultiModalItem("img", 12, 8)])
    tok1 = __import__("array").array("I", TOKENS[16:32]).tobytes()
    assert r.block_hashes[1] == h.hash_block(r.block_hashes[0], tok1, (("mm", "img", -4),))


def test_incremental_hashing_never_rehashes() -> None:
    calls = []
    h = BlockHasher(4)
    inner = h.hash_fn
    h.hash_fn = lambda data: calls.append(data) or inner(data)  # type: ignore[assignment]
    h.algo = "counted"
    r = CacheRequest("r", list(range(6)), hasher=h)
    assert len(calls) == 1 and len(r.block_hashes) == 1
    r.append_output_token_ids(6)
    assert len(calls) == 1
    r.append_output_token_ids(7)
    assert len(calls) == 2 and len(r.block_hashes) == 2
    r.append_output_token_ids([8, 9, 10, 11, 12])
    assert len(calls) == 3 and len(r.block_hashes) == 3
    full = CacheRequest("f", list(range(13)), hasher=BlockHasher(4))
    assert full.block_hashes == r.block_hashes


def test_bad_tokens_and_items_are_value_errors() -> None:
    h = BlockHasher(4)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        CacheRequest("r", [], hasher=h)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        CacheRequest("r", [1, -2], hasher=h)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        CacheRequest("r", [1, 2.5], hasher=h)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="mm_items"):
        CacheRequest("r", [1, 2], hasher=h, mm_items=[MultiModalItem("x", 1, 5)])
    with pytest.raises(ValueError, match="mm_items"):
        MultiModalItem("x", -1, 2)
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)
