"""The store tier's contract: a byte-level `KVStore` backend, the fingerprint that scopes its keys, the framing
of its values, and `BlockStore`, which turns backend faults into misses.

Why a fingerprint: a KV block's bytes are only valid for the exact model weights, dtype, block size, layer
group and page layout that wrote them (vLLM issue 56331: persisted blocks reused after a config change gave
wrong output). Every key therefore starts with a digest of all of those plus kvpool's format version, so a
replica with another configuration never even addresses another's blocks. Every value repeats that digest
and the block hash in a framed header and ends with an xxh3 checksum of header + payload: a torn write, a
bit flip, a key collision or a value written under another fingerprint all read back as a miss, never as
wrong bytes.

Why `BlockStore` swallows errors: the store is an optimisation. A store that is down, slow or full must
never fail a request, so every backend exception becomes a miss, one log line per outage, a counter, and a
back-off before the next attempt (which reconnects).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import xxhash

from kvpool.runner.file_identity import files_digest

log = logging.getLogger(__name__)

# Bumped whenever the value layout or the meaning of a payload changes: old values become unreachable.
FORMAT_VERSION = 1
_MAGIC = b"KVPB"
# magic, format version, fingerprint digest (16 bytes), block hash length, payload length
_HEADER = struct.Struct("<4sH16sHQ")
_CHECKSUM = struct.Struct("<Q")
_FAILED: Any = object()  # what `BlockStore._call` returns for a failed or skipped backend call


class StoreError(RuntimeError):
    """A backend could not complete a call (down, slow, full, or refused). Callers see misses instead.
    `refused`: the backend answered and said no (full: a server at its memory limit, a full disk), so it
    is not down, only not taking these writes."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass(frozen=True)
class Fingerprint:
    """Everything that makes a block's KV bytes valid. Two replicas share store entries only when equal."""

    model: str  # identity of the weights (see `model_identity`), not just a name
    dtype: str
    block_size: int
    # The layer group whose layers' K/V the value carries; -1 for a multi-group model, whose values carry
    # their group in the key (the host tier's group_key) and whose `layout` names every group.
    group: int = 0
    layout: str = ""  # page layout of the group: layers, K/V shape per block, byte order
    # How the KV was computed, beyond the weights: the model's dtype (fp32 weights over a bf16 cache give
    # other bytes than bf16 weights) and whether the kernels were the batch-invariant ones.
    compute: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if not self.model:
            raise ValueError("model: the fingerprint needs the weights' identity")

    @property
    def digest(self) -> bytes:
        """16 bytes; a canonical encoding of the fields (never repr/pickle, stable across processes)."""
        text = "\x1f".join([self.model, self.dtype, str(self.block_size), str(self.group), self.layout,
                            str(self.format_version), self.compute])
        return hashlib.sha256(b"kvpool/store-fingerprint\x00" + text.encode()).digest()[:16]

    def key(self, block_hash: bytes) -> bytes:
        return b"kvpool:" + self.digest.hex().encode() + b":" + block_hash.hex().encode()


def model_identity(model_dir: str | Path) -> str:
    """A digest standing for the model: its config and every byte of each weight file
    (`kvpool.runner.file_identity`: read once, then remembered while the files' stat is unchanged). A
    sample of each file would not do: a fine-tune of one tensor in the middle of a file changes neither
    its size nor its header nor its last bytes, and would read the original's KV (wrong tokens)."""
    root = Path(model_dir)
    files = [root / "config.json"] if (root / "config.json").is_file() else []
    files += [p for p in sorted(root.iterdir()) if p.suffix in (".safetensors", ".gguf", ".bin", ".pt")]
    return files_digest(files)


def encode_value(fp: Fingerprint, block_hash: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    header = _HEADER.pack(_MAGIC, fp.format_version, fp.digest, len(block_hash), len(payload))
    x = xxhash.xxh3_64()
    x.update(header)
    x.update(block_hash)
    x.update(payload)
    return b"".join([header, block_hash, payload, _CHECKSUM.pack(x.intdigest())])


def decode_value(fp: Fingerprint, block_hash: bytes, value: bytes | None) -> bytes | None:
    """The payload, or None when the value is absent, torn, corrupt, or written for another fingerprint or
    block."""
    if value is None:
        return None
    n = len(value)
    if n < _HEADER.size + _CHECKSUM.size:
        return None
    magic, version, digest, hlen, plen = _HEADER.unpack_from(value, 0)
    if (magic != _MAGIC or version != fp.format_version or digest != fp.digest
            or n != _HEADER.size + hlen + plen + _CHECKSUM.size):
        return None
    body_end = n - _CHECKSUM.size
    if value[_HEADER.size:_HEADER.size + hlen] != block_hash:
        return None
    if xxhash.xxh3_64_intdigest(memoryview(value)[:body_end]) != _CHECKSUM.unpack_from(value, body_end)[0]:
        return None
    return value[_HEADER.size + hlen:body_end]


def moving_average(old: float | None, new: float, weight: float) -> float:
    """An exponentially weighted moving average: `new` alone when there is none yet."""
    return float(new) if old is None else old + weight * (new - old)


@dataclass
class StoreStats:
    """Counters of one store; `latency_*` over backend calls (one call = one round trip)."""

    round_trips: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    lookups: int = 0  # blocks asked for
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # values present but rejected (checksum, fingerprint, length)
    errors: int = 0  # backend calls that failed (down, slow, full)
    skipped: int = 0  # calls not attempted while backing off after an error
    dropped_puts: int = 0  # blocks not written because the write queue was full
    latency_total_s: float = 0.0
    latency_max_s: float = 0.0
    read_calls: int = 0
    read_seconds: float = 0.0  # time inside successful reads
    # Moving averages over the reads that found something (for the fetch-or-recompute estimate): a read of
    # misses moves few bytes in one round trip and says little of what reading blocks costs.
    _fetch_s: float | None = field(default=None, repr=False, compare=False)
    _fetch_bytes: float | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    FETCH_EWMA = 0.3  # weight of the latest read (one slow read is forgotten within ~a dozen)

    def add(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def timed(self, seconds: float) -> None:
        with self._lock:
            self.round_trips += 1
            self.latency_total_s += seconds
            self.latency_max_s = max(self.latency_max_s, seconds)

    def fetched(self, seconds: float, nbytes: int) -> None:
        """A read that found `nbytes` of values took `seconds`."""
        if nbytes <= 0:
            return
        with self._lock:
            self._fetch_s = moving_average(self._fetch_s, seconds, self.FETCH_EWMA)
            self._fetch_bytes = moving_average(self._fetch_bytes, nbytes, self.FETCH_EWMA)

    def estimate_fetch_s(self, nbytes: int, round_trips: int = 1) -> float | None:
        """Expected seconds to read `nbytes` of values in `round_trips` calls, from recent reads that found
        something (None before any). An engine compares it with the time to recompute the blocks and waits
        only when the store is faster: a store slower than recomputing must not be waited on (LMCache issue
        914: a second instance reading from Redis took 20 s where recomputing took 8)."""
        with self._lock:
            per_call, mean_bytes = self._fetch_s, self._fetch_bytes
        if per_call is None or mean_bytes is None:
            return None
        # A read costs at least one mean round trip; beyond a mean-sized read, time grows with the bytes.
        return per_call * (max(1.0, nbytes / mean_bytes) + round_trips - 1)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        d["latency_mean_ms"] = 1000 * d["latency_total_s"] / d["round_trips"] if d["round_trips"] else 0.0
        return d


class KVStore(ABC):
    """A byte-level key-value backend. Calls are batched: one call is one round trip where the backend
    allows (a pipeline or MGET), and raise `StoreError` on any backend fault."""

    url: str

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None: ...

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    @abstractmethod
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def ping(self) -> None:  # noqa: B027 (optional)
        """Raise `StoreError` when the backend cannot be reached (a server down, a host that does not
        resolve); a backend with nothing to reach has nothing to check."""

    def close(self) -> None:  # noqa: B027 (optional)
        pass

    @abstractmethod
    def clear(self) -> int:
        """Delete every value kvpool stored here, of every fingerprint, and nothing else (the folder or
        database may hold other things); how many were deleted."""


class BlockStore:
    """Blocks of one fingerprint in a `KVStore`: framing, verification, stats, and fault isolation.

    Thread-safe as far as the backend is (both backends here are); `kvpool.store.worker` calls it from
    one background thread.
    """

    def __init__(self, store: KVStore, fingerprint: Fingerprint, *, retry_after_s: float = 1.0) -> None:
        self.store = store
        self.fp = fingerprint
        self.stats = StoreStats()
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self._down = False
        self._refusing = False  # the backend refused a write (full) and has not taken one since

    @property
    def available(self) -> bool:
        return not self._down

    def _call(self, what: str, fn: Any, *args: Any, counted: bool = True) -> Any:
        """Run one backend call; `_FAILED` when it failed or was skipped while backing off. A call that
        is not `counted` (a probe) moves no counter (a second's probe of a long outage is not an error
        each): only the up/down state."""
        now = time.monotonic()
        if self._down and now < self._down_until:
            if counted:
                self.stats.add(skipped=1)
            return _FAILED
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except Exception as e:  # any backend fault is a miss: the store never fails a request
            if counted:
                self.stats.add(errors=1)
            if isinstance(e, StoreError) and e.refused:
                # Up, but not taking writes: no back-off (reads work), one warning until writes work again.
                if not self._refusing:
                    log.warning("KV store %s: %s refused (%s); blocks are not stored until it takes them again",
                                self.store.url, what, e)
                self._refusing = True
                self._down = False  # (it answered)
                return _FAILED
            self._down_until = time.monotonic() + self.retry_after_s
            if not self._down:
                log.warning("KV store %s: %s failed (%s); serving from local tiers, retrying every %.1fs",
                            self.store.url, what, e, self.retry_after_s)
            self._down = True
            return _FAILED
        if counted:
            self.stats.timed(time.perf_counter() - t0)
        if self._down:
            log.warning("KV store %s: reachable again", self.store.url)
            self._down = False
        return out

    def probe(self) -> bool:
        """Whether the backend answers now (a failure is logged once and starts the back-off, as any
        call's). The worker probes at start, so a store that cannot be reached is reported when the
        replica starts rather than at its first use, and again while it is down, so the store is used
        again once it is back even when no traffic would try it."""
        return self._call("connect", self.store.ping, counted=False) is not _FAILED

    def put(self, blocks: Sequence[tuple[bytes, bytes | bytearray | memoryview]]) -> bool:
        """Write (block hash, payload) pairs in one round trip; False if the backend refused."""
        if not blocks:
            return True
        items = [(self.fp.key(h), encode_value(self.fp, h, p)) for h, p in blocks]
        if self._call("put", self.store.put_many, items) is _FAILED:
            return False
        self._refusing = False
        self.stats.add(bytes_written=sum(len(v) for _, v in items), blocks_written=len(items))
        return True

    def get(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """Payloads in order, None for each miss (absent, rejected, or the store unreachable)."""
        if not hashes:
            return []
        t0 = time.perf_counter()
        values = self._call("get", self.store.get_many, [self.fp.key(h) for h in hashes])
        took = time.perf_counter() - t0
        if values is not _FAILED:
            self.stats.add(read_calls=1, read_seconds=took)
        if values is _FAILED:
            self.stats.add(lookups=len(hashes), misses=len(hashes))
            return [None] * len(hashes)
        out: list[bytes | None] = []
        hits = corrupt = nbytes = 0
        for h, v in zip(hashes, values, strict=True):
            p = decode_value(self.fp, h, v)
            if v is not None:
                nbytes += len(v)
                if p is None:
                    corrupt += 1
            hits += p is not None
            out.append(p)
        self.stats.add(lookups=len(hashes), hits=hits, misses=len(hashes) - hits, corrupt=corrupt,
                       bytes_read=nbytes)
        self.stats.fetched(took, nbytes)
        if corrupt:
            log.warning("KV store %s: %d value(s) failed verification; treated as misses", self.store.url, corrupt)
        return out

    def exists(self, hashes: Sequence[bytes]) -> list[bool]:
        """Which blocks the store holds (without moving the bytes); all False when unreachable."""
        if not hashes:
            return []
        found = self._call("exists", self.store.exists_many, [self.fp.key(h) for h in hashes])
        return [False] * len(hashes) if found is _FAILED else list(found)

    def prefix_length(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a chain the store holds (one round trip)."""
        n = 0
        for present in self.exists(hashes):
            if not present:
                break
            n += 1
        return n

    def close(self) -> None:
        self.store.close()
