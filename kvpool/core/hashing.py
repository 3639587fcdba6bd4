"""Block hashes: H(parent hash, block tokens, extra keys), chained from a root hash.

The byte encoding is canonical (fixed-width little-endian token ids, length-prefixed extra keys), never
pickle, so the same tokens give the same hash in every process and on every machine: a router or
another replica computes what we compute. A secret seed changes the root, which makes every hash of a
deployment unguessable (with the collision-resistant algorithm) while staying deterministic within it.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable

import xxhash

from kvpool.core.request import CacheRequest, token_array

HASH_ALGOS: dict[str, Callable[[bytes], bytes]] = {
    # Collision-resistant default.
    "sha256": lambda data: hashlib.sha256(data).digest(),
    # Fast non-cryptographic option: 128 bits, collisions negligible for a cache but not adversarial-proof.
    "xxh3_128": xxhash.xxh3_128_digest,
}
_ALIASES = {"xxhash": "xxh3_128", "xxh3": "xxh3_128"}
_ROOT_DOMAIN = b"kvpool/block-hash/v1"
_LITTLE = sys.byteorder == "little"

ExtraKeys = tuple[tuple[object, ...], ...]


def resolve_hash_algo(name: str) -> str:
    algo = _ALIASES.get(name, name)
    if algo not in HASH_ALGOS:
        raise ValueError(f"hash_algo: unknown algorithm {name!r}; choose one of {sorted(HASH_ALGOS)}")
    return algo


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def block_extra_keys(request: CacheRequest, start: int, end: int) -> ExtraKeys:
    """The extra keys of the block holding tokens [start, end): LoRA, overlapping mm items, salt."""
    keys: list[tuple[object, ...]] = []
    if request.lora_id is not None:
        keys.append(("lora", request.lora_id))
        if request.lora_content is not None:
            keys.append(("lora-content", request.lora_content))
    for m in request.mm_items:
        if m.offset >= end:
            break
        if m.offset + m.length > start:
            keys.append(("mm", m.content_hash, m.offset - start))
    if start == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    return tuple(keys)


def encode_extra_keys(keys: ExtraKeys) -> bytes:
    if not keys:
        return b""
    out = [b"\x01"]
    for key in keys:
        kind = key[0]
        if kind == "lora":
            lora = key[1]
            if isinstance(lora, int):
                out.append(b"Li" + struct.pack("<q", lora))
            else:
                out.append(b"Ls" + _lp(str(lora).encode()))
        elif kind == "lora-content":
            out.append(b"Lc" + _lp(str(key[1]).encode()))
        elif kind == "mm":
            out.append(b"M" + _lp(str(key[1]).encode()) + struct.pack("<q", key[2]))
        elif kind == "salt":
            out.append(b"S" + _lp(str(key[1]).encode()))
        else:
            raise ValueError(f"extra_keys: unknown kind {kind!r}")
    return b"".join(out)


def check_hash_seed(seed: object) -> None:
    """A ValueError naming `hash_seed` unless it is None, or a non-empty string or bytes: an empty seed
    would hash exactly as no seed, which is not what a user who gave one meant."""
    if seed is None:
        return
    if not isinstance(seed, str | bytes):
        raise ValueError(f"hash_seed: must be a string, bytes or None, got {seed!r}")
    if not seed:
        raise ValueError("hash_seed: empty (it would hash as no seed); give a value, or leave it out for none")


class BlockHasher:
    """Computes a request's block hashes incrementally, for full blocks only."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | bytes | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        check_hash_seed(seed)
        self.block_size = block_size
        self.algo = resolve_hash_algo(algo)
        self.hash_fn = HASH_ALGOS[self.algo]
        seed_bytes = seed.encode() if isinstance(seed, str) else (seed or b"")
        # The parent of the first block; the seed enters every hash through it.
        self.root_hash: bytes = self.hash_fn(_ROOT_DOMAIN + _lp(seed_bytes))

    def hash_block(self, parent: bytes, token_bytes: bytes, extra_keys: ExtraKeys = ()) -> bytes:
        return self.hash_fn(parent + token_bytes + encode_extra_keys(extra_keys))

    def extend(self, request: CacheRequest, buf: array | None = None) -> None:
        """Append the hashes of the request's blocks that became full since the last call."""
        bs = self.block_size
        hashes = request.block_hashes
        first = len(hashes)
        tokens = request.all_token_ids
        num_full = len(tokens) // bs
        if num_full <= first:
            return
        if buf is None or len(buf) != len(tokens):
            buf = token_array(tokens[first * bs : num_full * bs], "token_ids")
            base = first * bs
        else:
            base = 0
        if not _LITTLE:
            buf = array("I", buf)
            buf.byteswap()
        data = buf.tobytes()
        parent = hashes[-1] if hashes else self.root_hash
        width = bs * 4
        off = (first * bs - base) * 4
        end = (num_full * bs - base) * 4
        if not request.has_extra_keys:
            # The hot path (no LoRA, no images, no salt): one C call per block where the algorithm allows.
            if self.algo == "sha256":
                sha = hashlib.sha256
                while off < end:
                    parent = sha(parent + data[off:off + width]).digest()
                    hashes.append(parent)
                    off += width
            else:
                h = self.hash_fn
                while off < end:
                    parent = h(parent + data[off:off + width])
                    hashes.append(parent)
                    off += width
            return
        h = self.hash_fn
        for i in range(first, num_full):
            off = (i * bs - base) * 4
            extra = encode_extra_keys(block_extra_keys(request, i * bs, (i + 1) * bs))
            parent = h(parent + data[off : off + width] + extra)
            hashes.append(parent)
