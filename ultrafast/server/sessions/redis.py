"""The shared session store: Redis (several server processes, restarts, RELIABILITY S3)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict

from ultrafast.server.sessions.store import (
    SeqConflict,
    SessionInfo,
    SessionStore,
    StoreConfig,
    StoredObject,
    StoreUnavailable,
    TooManySessions,
    Turn,
)

# Append in one atomic step: an id already stored returns its turn (the retry after a lost
# reply); else the turn gets seq = list length. KEYS: meta, turns list, id->seq hash, tenant
# index. ARGV: turn id, turn json with seq -1 placeholder, ttl ms, now, expected seq or ''.
_APPEND_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, ''} end
local seq = redis.call('HGET', KEYS[3], ARGV[1])
if seq then return {tonumber(seq), redis.call('LINDEX', KEYS[2], tonumber(seq))} end
local n = redis.call('LLEN', KEYS[2])
if ARGV[5] ~= '' and tonumber(ARGV[5]) ~= n then return {-2, ''} end
local body = string.gsub(ARGV[2], '"seq":%-1', '"seq":' .. n, 1)
redis.call('RPUSH', KEYS[2], body)
redis.call('HSET', KEYS[3], ARGV[1], n)
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
redis.call('ZADD', KEYS[4], ARGV[4], KEYS[1])
return {n, body}
"""

# Create unless the tenant is at its bound; expired sessions leave the index first.
# KEYS: meta, tenant index. ARGV: meta json, ttl ms, now, cutoff, max sessions.
_CREATE_LUA = """
local meta = redis.call('GET', KEYS[1])
if meta then return {0, meta} end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then return {1, ''} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
return {0, ARGV[1]}
"""


class RedisStore(SessionStore):
    """Keys are namespaced `t:{tenant}:s:{session}` (RELIABILITY S3). Every write is a Lua script,
    so a reply lost to a Redis restart is safe to retry with the same turn id."""

    def __init__(self, config: StoreConfig):
        import redis.asyncio as aioredis  # only when Redis is configured
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        from ultrafast.redis_conn import client_options

        self.config = config
        self._errors = (aioredis.RedisError, OSError, asyncio.TimeoutError)
        # A pooled connection that a Redis restart or a link reset killed fails on its next
        # write; retry such a call on a fresh connection (every write is an idempotent script,
        # so a retry never duplicates a turn). Timeouts are not retried: the deadline holds.
        self._redis = aioredis.Redis.from_url(
            config.url,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            max_connections=64,
            health_check_interval=5,
            retry=Retry(
                ExponentialBackoff(cap=0.2, base=0.01), 3, supported_errors=(RedisConnectionError,)
            ),
            retry_on_error=[RedisConnectionError],
            **client_options(config.url, config.ca_file),
        )
        self._append = self._redis.register_script(_APPEND_LUA)
        self._create = self._redis.register_script(_CREATE_LUA)

    @staticmethod
    def _keys(tenant: str, session_id: str) -> tuple[str, str, str, str]:
        base = f"t:{tenant}:s:{session_id}"
        return base, base + ":turns", base + ":ids", f"t:{tenant}:sessions"

    async def _call(self, coro):
        try:
            return await coro
        except self._errors as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.config.ttl_s * 1000))

    async def create(self, tenant, session_id, metadata=None):
        meta_key, _, _, index = self._keys(tenant, session_id)
        now = time.time()
        meta = json.dumps({"created_s": now, "metadata": metadata or {}})
        full, body = await self._call(
            self._create(
                keys=[meta_key, index],
                args=[
                    meta,
                    self._ttl_ms,
                    now,
                    now - self.config.ttl_s,
                    self.config.max_sessions_per_tenant,
                ],
            )
        )
        if full:
            raise TooManySessions()
        stored = json.loads(body)
        return SessionInfo(session_id, stored["created_s"], stored["metadata"])

    async def get(self, tenant, session_id):
        body = await self._call(self._redis.get(self._keys(tenant, session_id)[0]))
        if body is None:
            return None
        stored = json.loads(body)
        return SessionInfo(session_id, stored["created_s"], stored["metadata"])

    async def turns(self, tenant, session_id, upto_seq=None):
        _, turns_key, _, _ = self._keys(tenant, session_id)
        end = -1 if upto_seq is None else upto_seq
        bodies = await self._call(self._redis.lrange(turns_key, 0, end))
        return [Turn.from_json(b) for b in bodies]

    async def append(self, tenant, session_id, turn, expect_seq=None):
        keys = list(self._keys(tenant, session_id))
        body = Turn(**{**asdict(turn), "seq": -1}).to_json()
        seq, stored = await self._call(
            self._append(
                keys=keys,
                args=[
                    turn.turn_id,
                    body,
                    self._ttl_ms,
                    time.time(),
                    "" if expect_seq is None else expect_seq,
                ],
            )
        )
        if seq == -2:
            raise SeqConflict()
        if seq < 0:
            raise KeyError(session_id)
        return Turn.from_json(stored)

    async def delete(self, tenant, session_id):
        keys = self._keys(tenant, session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(*keys[:3])
            pipe.zrem(keys[3], keys[0])
            deleted, _ = await self._call(pipe.execute())
        return deleted > 0

    async def set_metadata(self, tenant, session_id, metadata):
        meta_key = self._keys(tenant, session_id)[0]
        body = await self._call(self._redis.get(meta_key))
        if body is None:
            return None
        stored = json.loads(body)
        stored["metadata"] = dict(metadata)
        await self._call(self._redis.set(meta_key, json.dumps(stored), px=self._ttl_ms))
        return SessionInfo(session_id, stored["created_s"], stored["metadata"])

    @staticmethod
    def _object_keys(tenant: str, kind: str, object_id: str) -> tuple[str, str]:
        return f"t:{tenant}:o:{kind}:{object_id}", f"t:{tenant}:o:{kind}"

    async def put_object(self, tenant, kind, object_id, obj):
        key, index = self._object_keys(tenant, kind, object_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(key, obj.to_json(), px=self._ttl_ms)
            pipe.zadd(index, {object_id: obj.created_s})
            pipe.pexpire(index, self._ttl_ms)
            await self._call(pipe.execute())

    async def get_object(self, tenant, kind, object_id):
        body = await self._call(self._redis.get(self._object_keys(tenant, kind, object_id)[0]))
        return None if body is None else StoredObject.from_json(body)

    async def delete_object(self, tenant, kind, object_id):
        key, index = self._object_keys(tenant, kind, object_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.zrem(index, object_id)
            deleted, _ = await self._call(pipe.execute())
        return deleted > 0

    async def list_objects(self, tenant, kind):
        _, index = self._object_keys(tenant, kind, "")
        ids = await self._call(self._redis.zrange(index, 0, -1))
        if not ids:
            return []
        names = [i.decode() if isinstance(i, bytes) else i for i in ids]
        bodies = await self._call(
            self._redis.mget([self._object_keys(tenant, kind, i)[0] for i in names])
        )
        expired = [i for i, b in zip(names, bodies) if b is None]
        if expired:  # their keys timed out; the index forgets them
            await self._call(self._redis.zrem(index, *expired))
        return [StoredObject.from_json(b) for b in bodies if b is not None]

    async def ping(self):
        await self._call(self._redis.ping())

    async def close(self):
        await self._redis.aclose()
