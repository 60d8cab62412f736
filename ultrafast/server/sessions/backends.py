"""Which backend a session store URL names: sqlite:///path (embedded) or redis://host:port/db."""

from __future__ import annotations

from urllib.parse import urlparse

from ultrafast.server.sessions.store import (
    DEFAULT_MAX_SESSIONS_PER_TENANT,
    DEFAULT_TTL_S,
    SessionStore,
    StoreConfig,
)


def open_store(
    url: str,
    ttl_s: float = DEFAULT_TTL_S,
    max_sessions_per_tenant: int = DEFAULT_MAX_SESSIONS_PER_TENANT,
    ca_file: str | None = None,
) -> SessionStore:
    """The store `url` names; a Redis URL is checked once (redis_conn.check_at_start: refused
    credentials or a failed TLS handshake are a ValueError, a start-up error)."""
    config = StoreConfig(url, ttl_s, max_sessions_per_tenant, ca_file=ca_file)
    scheme = urlparse(url).scheme
    if scheme == "sqlite":
        from ultrafast.server.sessions.sqlite import SQLiteStore

        return SQLiteStore(config)
    if scheme in ("redis", "rediss", "unix"):
        from ultrafast.redis_conn import check_at_start
        from ultrafast.server.sessions.redis import RedisStore  # redis-py only when configured

        check_at_start(url, "session store (--session-store)", ca_file)
        return RedisStore(config)
    raise ValueError(
        f"session store URL must be sqlite:///path or redis://host:port/db, not {url!r}"
    )
