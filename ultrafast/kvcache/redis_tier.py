"""L3 in Redis: blobs shared by every server process of the same model (and surviving them).

Keys are `uf:kv:<key>` with a TTL. The client has short timeouts: a Redis outage costs one
timeout, then the tier is skipped for a moment (FailureLog) and turns recompute.
Only the engine's worker thread calls it, never the engine thread.
"""

from __future__ import annotations

import threading

from ultrafast.kvcache.tiers import FailureLog, TierStats

KEY_PREFIX = "uf:kv:"


class RedisTier:
    name = "redis"

    def __init__(
        self,
        url: str,
        ttl_s: int = 86400,
        ca_file: str | None = None,
        max_blob_bytes: int = 512 << 20,
    ):
        import redis  # a core dependency; imported only when configured

        from ultrafast.redis_conn import check_at_start, client_options

        check_at_start(url, "KV store (--kv-store)", ca_file)  # refused credentials: ValueError
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._redis = redis.Redis.from_url(
            url, socket_timeout=2.0, socket_connect_timeout=1.0, **client_options(url, ca_file)
        )
        self.url, self.ttl_s, self.max_blob_bytes = url, ttl_s, max_blob_bytes
        self.stats = TierStats()
        self._failures = FailureLog(self.name, self.stats)
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        if self._failures.skipping():
            return None
        try:
            blob = self._redis.get(KEY_PREFIX + key)
        except self._errors as exc:
            self._failures.failed("GET", exc)
            return None
        self._failures.ok()
        with self._lock:
            if not isinstance(blob, bytes):  # a miss (None); the client never decodes
                self.stats.num_misses += 1
                return None
            self.stats.num_gets += 1
            self.stats.bytes_read += len(blob)
        return blob

    def longest(self, keys: list[str]) -> str | None:
        """The last of `keys` that Redis holds (one round trip), None on a miss or an outage."""
        if not keys or self._failures.skipping():
            return None
        try:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(KEY_PREFIX + key)
            found = pipe.execute()
        except self._errors as exc:
            self._failures.failed("EXISTS", exc)
            return None
        self._failures.ok()
        for key, hit in zip(reversed(keys), reversed(found)):
            if hit:
                return key
        return None

    def contains(self, key: str) -> bool:
        return self.longest([key]) == key

    def put(self, key: str, blob: bytes) -> bool:
        if len(blob) > self.max_blob_bytes or self._failures.skipping():
            return False
        try:
            self._redis.set(KEY_PREFIX + key, blob, ex=self.ttl_s)
        except self._errors as exc:
            self._failures.failed("SET", exc)
            return False
        self._failures.ok()
        with self._lock:
            self.stats.num_puts += 1
            self.stats.bytes_written += len(blob)
        return True

    def delete(self, key: str) -> None:
        try:
            self._redis.delete(KEY_PREFIX + key)
        except self._errors as exc:
            self._failures.failed("DEL", exc)

    def close(self) -> None:
        self._redis.close()
