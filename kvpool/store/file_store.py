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


class FileStore(KVStore):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_store: cannot create the store directory {self.root}: {e}") from None

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
                    with os.fdopen(fd, "wb") as f:
                        f.write(value)
                    os.replace(tmp, path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
        except OSError as e:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            raise StoreError(f"{'full' if full else 'I/O error'}: {e}", refused=full) from e

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self._path(key).read_bytes())
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                raise StoreError(f"I/O error: {e}") from e
        return out

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self._path(k).is_file() for k in keys]

