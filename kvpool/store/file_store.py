"""`file:///path`: the embedded store, a directory on local disk (no server; persists across restarts).

One file per key under a two-level fan-out of its hash (no directory with millions of entries). Writes go
to a temporary file in the same directory and are renamed into place, which POSIX makes atomic: a reader
sees the old value, the new one or none, never a torn one (and the value's checksum would catch a torn
file anyway, e.g. after a power loss without fsync, which we skip for speed: a lost block is a miss).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
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
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_store: cannot create the store directory {self.root}: {e}") from None
        # Files as any other file this process creates (mkstemp's are 0600): replicas of other users
        # sharing the directory read them, as the umask allows.
        self.mode = 0o666 & ~_umask()

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
            try:
                out.append(self._path(key).read_bytes())
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                if e.errno in _REFUSED:
                    out.append(None)  # one file this process may not read: a miss for that key only
                    continue
                raise StoreError(f"I/O error: {e}") from e
        return out

    def ping(self) -> None:
        """The directory is there and searchable (a store whose disk went away is down)."""
        if not os.access(self.root, os.X_OK) or not self.root.is_dir():
            raise StoreError(f"the store directory {self.root} is gone or not searchable")

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for key in keys:
            try:
                out.append(self._path(key).is_file())
            except OSError as e:  # (is_file raises for a fan-out directory this process may not search)
                if e.errno in _REFUSED:
                    out.append(False)  # a miss for that key only, as in get_many
                    continue
                raise StoreError(f"I/O error: {e}") from e
        return out

