"""`file:///path[?max_size=SIZE]`: the embedded store, a directory on local disk (no server; persists across
restarts).

`max_size` (e.g. `10GiB`) bounds the bytes of the values this store keeps: past it, the least recently
written or read values are deleted (a value read is touched, so its file's time says when it was last used,
across restarts too). Without it the directory grows until the disk is full, and then refuses writes,
starving whatever else shares the disk. The bound is this process's view: what it wrote and read, and what
was there when it opened; replicas sharing a directory should give it the same bound, which then holds
within what one replica writes between the others' evictions.

One file per key under a two-level fan-out of its hash (no directory with millions of entries). Writes go
to a temporary file in the same directory and are renamed into place, which POSIX makes atomic: a reader
sees the old value, the new one or none, never a torn one (and the value's checksum would catch a torn
file anyway, e.g. after a power loss without fsync, which we skip for speed: a lost block is a miss).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvpool.store.base import KVStore, StoreError

# Errors of one file or of the directory's permissions: the store answered and refused (a write), or has
# no usable value for that key (a read). Neither means the store is down: backing off and probing again
# would only repeat them (and log them) forever.
_REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class FileStore(KVStore):
    def __init__(self, root: str | Path, max_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_store: cannot create the store directory {self.root}: {e}") from None
        # Files as any other file this process creates (mkstemp's are 0600): replicas of other users
        # sharing the directory read them, as the umask allows.
        self.mode = 0o666 & ~_umask()
        self.max_bytes = max_bytes
        self.evicted = 0  # values deleted to stay within max_bytes
        # With a bound: every value file's size, least recently used first.
        self._lru: OrderedDict[Path, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        if max_bytes is not None:
            self._scan()

    def _scan(self) -> None:
        """What the directory holds now, oldest first (by the files' times: written, or last read)."""
        found = []
        for top in os.scandir(self.root):
            if not top.is_dir() or top.name.startswith("."):
                continue
            for sub in os.scandir(top.path):
                if not sub.is_dir():
                    continue
                for f in os.scandir(sub.path):
                    if f.name.startswith(".tmp-") or not f.is_file():
                        continue
                    with contextlib.suppress(OSError):
                        st = f.stat()
                        found.append((st.st_mtime_ns, Path(f.path), st.st_size))
        for _, path, size in sorted(found, key=lambda x: (x[0], str(x[1]))):
            self._lru[path] = size
            self._bytes += size
        self._evict()

    def _used(self, path: Path, size: int | None) -> None:
        """`path` was written (`size` bytes) or read (None): the most recently used value now."""
        if self.max_bytes is None:
            return
        with self._lock:
            if size is None:
                if path in self._lru:
                    self._lru.move_to_end(path)
                with contextlib.suppress(OSError):
                    os.utime(path)  # (the order survives a restart)
                return
            self._bytes += size - self._lru.pop(path, 0)
            self._lru[path] = size
            self._evict()

    def _evict(self) -> None:
        while self.max_bytes is not None and self._bytes > self.max_bytes and self._lru:
            path, size = self._lru.popitem(last=False)
            self._bytes -= size
            self.evicted += 1
            with contextlib.suppress(OSError):  # (another replica may have deleted it already)
                path.unlink()

    def _path(self, key: bytes) -> Path:
        name = key.decode().replace(":", "_")
        tail = name[-4:]  # the block hash's last hex digits spread keys evenly
        return self.root / tail[:2] / tail[2:] / name

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        try:
            for key, value in items:
                path = self._path(key)
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
                try:
                    os.fchmod(fd, self.mode)
                    with os.fdopen(fd, "wb") as f:
                        f.write(value)
                    os.replace(tmp, path)
                    self._used(path, len(value))
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
        except OSError as e:
            refused = e.errno in _REFUSED
            raise StoreError(f"{'refused' if refused else 'I/O error'}: {e}", refused=refused) from e

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            try:
                value = _read_regular(path)
            except FileNotFoundError:
                value = None
            except OSError as e:
                # One file's fault (unreadable, a fan-out path that is not a folder, a bad disk sector) is a
                # miss for that key only; the store is down only when its directory is.
                self._check_root(e)
                value = None
            if value is not None:
                self._used(path, None)
            out.append(value)
        return out

    def _check_root(self, e: OSError) -> None:
        if not self.root.is_dir():
            raise StoreError(f"I/O error: {e}") from e

    def ping(self) -> None:
        """The directory is there and searchable (a store whose disk went away is down)."""
        if not os.access(self.root, os.X_OK) or not self.root.is_dir():
            raise StoreError(f"the store directory {self.root} is gone or not searchable")

    def clear(self) -> int:
        try:
            n = _clear(self.root)
        except OSError as e:
            raise StoreError(f"I/O error: {e}") from e
        with self._lock:
            self._lru.clear()
            self._bytes = 0
        return n

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for key in keys:
            try:
                out.append(self._path(key).is_file())
            except OSError as e:  # (is_file raises for a fan-out directory this process may not search)
                self._check_root(e)
                out.append(False)  # a miss for that key only, as in get_many
        return out


def _is_fanout(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _clear(root: Path) -> int:
    """Delete the store's value files (and half-written ones) under `root`'s two levels of fan-out folders,
    then those folders once empty; anything else in `root` stays."""
    n = 0
    for top in os.scandir(root):
        if not (_is_fanout(top.name) and top.is_dir(follow_symlinks=False)):
            continue
        for sub in os.scandir(top.path):
            if not (_is_fanout(sub.name) and sub.is_dir(follow_symlinks=False)):
                continue
            for f in os.scandir(sub.path):
                if f.name.startswith(("kvpool_", ".tmp-")) and f.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):  # (another replica's eviction)
                        os.unlink(f.path)
                        n += 1
            with contextlib.suppress(OSError):  # (not empty: something else is in it)
                os.rmdir(sub.path)
        with contextlib.suppress(OSError):
            os.rmdir(top.path)
    return n


def _read_regular(path: Path) -> bytes | None:
    """The bytes of the regular file at `path`; None for anything else found there (a folder, a FIFO, a
    device: read as a file, a FIFO would block the store's thread for good)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with open(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)
