"""`redis://host:port[/db]`: a Redis-protocol server shared by replicas (Redis or Valkey; `valkey://` is an
alias). Each batch is one round trip: SETs in one non-transactional pipeline, reads with one MGET.

A short connect timeout (0.5 s) finds a dead server fast; reads and writes get 2 s, enough for a batch of
many MiB (16 blocks of SmolLM2 are 11 MiB: ~0.1 s on loopback), and only the store worker ever waits on
them. redis-py opens a new connection on the next call after a failure, which is the reconnect. A server
at its memory limit under `noeviction` answers writes with an OOM error: that is "full", and the blocks are
simply not stored (configure the server with `maxmemory` and `maxmemory-policy allkeys-lru` to make it a cache instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qs, unquote, urlparse

from kvpool.store.base import KVStore, StoreError


class RedisStore(KVStore):
    def __init__(self, url: str, *, timeout_s: float = 2.0, connect_timeout_s: float = 0.5, ttl_s: int | None = None
                 ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        u = urlparse(url)
        if not u.hostname:
            raise ValueError(f"kv_store: {url!r} names no host (expected redis://HOST:PORT)")
        try:
            port = u.port or 6379
        except ValueError as e:  # urllib's "Port out of range 0-65535"
            raise ValueError(f"kv_store: {url!r}: {e}") from None
        q = parse_qs(u.query, keep_blank_values=True)
        unknown = sorted(set(q) - {"ttl"})
        if unknown:
            raise ValueError(f"kv_store: unknown option(s) {unknown} in {url!r} (the only one is ttl=SECONDS)")
        if "ttl" in q:
            try:
                ttl_s = int(q["ttl"][0])
            except ValueError:
                raise ValueError(f"kv_store: ttl={q['ttl'][0]!r} is not a whole number of seconds") from None
            if ttl_s < 1:  # (the server refuses every SET with a zero or negative expiry)
                raise ValueError(f"kv_store: ttl must be >= 1 second, got {ttl_s}")
        try:
            db = int(u.path.strip("/") or 0)
        except ValueError:
            raise ValueError(f"kv_store: database {u.path!r} is not a number") from None
        if db < 0:
            raise ValueError(f"kv_store: database must be >= 0, got {db}")
        self.url = f"redis://{u.hostname}:{port}/{db}"
        self.ttl_s = ttl_s
        self._errors = (redis.RedisError, OSError)
        self._refusals = (redis.ResponseError,)
        # Credentials are percent-encoded in a URL (RFC 3986; a password with '@' or ':' must be): decoded
        # here as redis-py's own from_url decodes them.
        self.client = redis.Redis(host=u.hostname, port=port, db=db,
                                  password=unquote(u.password) if u.password is not None else None,
                                  username=unquote(u.username) if u.username is not None else None,
                                  socket_timeout=timeout_s,
                                  socket_connect_timeout=connect_timeout_s,
                                  # No retries inside a call: BlockStore backs off and tries again later.
                                  retry=Retry(NoBackoff(), 0), health_check_interval=0)

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for k, v in items:
                pipe.set(k, v, ex=self.ttl_s)
            pipe.execute()
        except self._refusals as e:  # the server answered no: OOM at maxmemory, a read-only replica
            raise StoreError(str(e), refused=True) from e
        except self._errors as e:
            raise StoreError(str(e)) from e

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        try:
            return list(self.client.mget(keys))
        except self._errors as e:
            raise StoreError(str(e)) from e

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(n) for n in pipe.execute()]
        except self._errors as e:
            raise StoreError(str(e)) from e

    def ping(self) -> None:
        try:
            self.client.ping()
        except self._errors as e:
            raise StoreError(str(e)) from e

    def clear(self) -> int:
        """kvpool's keys only (SCAN by their prefix, UNLINK in batches): never FLUSHDB on a database that
        may hold other data."""
        n = 0
        try:
            batch: list[bytes] = []
            for key in self.client.scan_iter(match=b"kvpool:*", count=1000):
                batch.append(key)
                if len(batch) == 1000:
                    n += self.client.unlink(*batch)
                    batch = []
            if batch:
                n += self.client.unlink(*batch)
        except self._errors as e:
            raise StoreError(str(e)) from e
        return n

    def close(self) -> None:
        self.client.close()
