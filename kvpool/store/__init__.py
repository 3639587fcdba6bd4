"""The store tier: KV blocks below the host tier, in a local directory or a Redis/Valkey server shared by
replicas, with its I/O on a background thread (`worker`). See `base` for keys, values and fault handling."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from kvpool.store.base import (
    FORMAT_VERSION,
    BlockStore,
    Fingerprint,
    KVStore,
    StoreError,
    StoreStats,
    decode_value,
    encode_value,
    model_identity,
)


def open_store(url: str) -> KVStore:
    """A backend from its URL: `file:///abs/path[?max_size=SIZE]` or `redis://host:port[/db][?ttl=SECONDS]`
    (`valkey://` is the same protocol)."""
    return _backend(url)()


def check_store_url(url: str) -> None:
    """ValueError naming `kv_store` for a URL `open_store` would refuse, found without creating a folder or
    connecting to a server (configurations are checked before a model loads)."""
    _backend(url)


def _backend(url: str) -> Callable[[], KVStore]:
    """The URL checked, and what opens it."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"kv_store: {url!r} is not a URL (file:///path or redis://host:port)")
    u = urlparse(url)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost"):
            raise ValueError(f"kv_store: file URLs name a local path, got host {u.netloc!r} (use file:///abs/path)")
        if not u.path:
            raise ValueError("kv_store: file:// URL without a path")
        from kvpool.store.file_store import FileStore

        q = parse_qs(u.query, keep_blank_values=True)
        unknown = sorted(set(q) - {"max_size"})
        if unknown:  # (ignored, silently, before: a bound the user asked for would not hold)
            raise ValueError(f"kv_store: unknown option(s) {unknown} in {url!r} (the only one is max_size=SIZE)")
        max_bytes = None
        if "max_size" in q:
            from kvpool.engine.config import parse_size

            max_bytes = parse_size(q["max_size"][0], "kv_store: max_size")
        return lambda: FileStore(Path(unquote(u.path)), max_bytes)
    if u.scheme in ("redis", "valkey"):
        from kvpool.store.redis_store import RedisStore

        RedisStore(url).close()  # (its URL's checks; a client connects only when used)
        return lambda: RedisStore(url)
    raise ValueError(f"kv_store: unknown scheme {u.scheme!r} in {url!r}; use file:// or redis://")


__all__ = ["FORMAT_VERSION", "BlockStore", "Fingerprint", "KVStore", "StoreError", "StoreStats", "check_store_url",
           "decode_value",
           "encode_value", "model_identity", "open_store"]
