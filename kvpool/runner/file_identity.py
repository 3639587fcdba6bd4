"""What a set of files holds, as one digest: every byte of each file, remembered by its stat.

KV bytes are valid only for the exact weights that computed them, so what identifies a model (or a LoRA
adapter) to a store shared by replicas and kept across restarts is its content, not its name or a sample
of it: a fine-tune that changes one tensor in the middle of a file changes nothing else (not the size,
not the header, not the last bytes), and reading its neighbour's KV would give wrong tokens.

Hashing the whole file (xxh3-128, several GB/s) costs a fraction of loading it. The digest is also kept in
kvpool's cache directory keyed by the file's path, size, inode and modification and change times (the
change time moves on any write, and no tool can set it back), so a restart of a replica whose weights did
not change reads nothing again. A cache that cannot be read or written is only slower.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

import xxhash

from kvpool.runner.model_files import cache_dir

log = logging.getLogger(__name__)

_CACHE_NAME = "file-digests.json"
_CACHE_ENTRIES = 512  # files remembered (oldest dropped): a few models' and adapters' weights
_CHUNK = 16 << 20
_lock = threading.Lock()
_memo: dict[str, tuple[list[int], str]] = {}


def _stamp(path: Path) -> tuple[str, list[int]]:
    st = path.stat()
    return str(path.resolve()), [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]


def _load_cache(file: Path) -> dict[str, tuple[list[int], str]]:
    try:
        raw = json.loads(file.read_text())
        return {k: (list(v[0]), str(v[1])) for k, v in raw.items()}
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return {}


def _save_cache(file: Path, entries: dict[str, tuple[list[int], str]]) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        keep = dict(list(entries.items())[-_CACHE_ENTRIES:])
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".file-digests-")
        with os.fdopen(fd, "w") as f:
            json.dump(keep, f)
        os.replace(tmp, file)  # atomic: a concurrent reader sees the old cache or the new one
    except OSError as e:
        log.debug("file digests not cached (%s)", e)


def file_digest(path: str | Path) -> str:
    """xxh3-128 of the file's whole content, hex; from the cache while its stat is unchanged."""
    p = Path(path)
    key, stamp = _stamp(p)
    with _lock:
        hit = _memo.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        cache_file = cache_dir() / _CACHE_NAME
        disk = _load_cache(cache_file)
        hit = disk.get(key)
        if hit is not None and hit[0] == stamp:
            _memo[key] = hit
            return hit[1]
    x = xxhash.xxh3_128()
    with p.open("rb") as f:
        while chunk := f.read(_CHUNK):
            x.update(chunk)
    digest = x.hexdigest()
    if _stamp(p)[1] != stamp:  # written while being read: what was read is not a version of the file
        raise OSError(f"{p}: changed while its digest was computed")
    with _lock:
        _memo[key] = (stamp, digest)
        disk = _load_cache(cache_file)
        disk.pop(key, None)
        disk[key] = (stamp, digest)
        _save_cache(cache_file, disk)
    return digest


def files_digest(files: Iterable[Path]) -> str:
    """One digest of several files: each one's name and whole content, in the order given."""
    h = hashlib.sha256(b"kvpool/files\x00")
    for p in files:
        h.update(p.name.encode() + b"\x00" + file_digest(p).encode() + b"\x00")
    return h.hexdigest()[:32]
