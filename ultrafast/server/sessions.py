"""Session store: the server-side history of conversations, SQLite (embedded default) or Redis.

One async interface, two backends. A session (OpenAI: a conversation) belongs to one tenant and
holds turns; each turn has a `turn_id` (the idempotency key: appending an id that is already in
the session returns the stored turn, so a retried append after a lost reply never duplicates)
and a `seq` (0, 1, 2, ... in append order, assigned atomically by the store). Responses (the
Responses API's stored objects) are records that point at a session and the seq they end at.

Sessions expire `ttl_s` after their last write; each tenant holds at most
`max_sessions_per_tenant` live sessions (creating one more is refused, never silently evicting a
client's data). Every backend failure is raised as `StoreUnavailable`, which the routes answer
with 503 `session_store_unavailable`; nothing here blocks the event loop (SQLite runs on its own
thread, Redis through redis-py's asyncio client). Never imports torch (DESIGN rule 1).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

DEFAULT_TTL_S = 30 * 24 * 3600.0  # OpenAI keeps stored responses 30 days
DEFAULT_MAX_SESSIONS_PER_TENANT = 10_000


class StoreUnavailable(Exception):
    """The backend did not answer (connection refused, timeout, disk error)."""


class TooManySessions(Exception):
    """The tenant already holds `max_sessions_per_tenant` live sessions."""


class SeqConflict(Exception):
    """`append(expect_seq=k)` found the session already longer than k turns (a branch)."""


@dataclass
class Turn:
    turn_id: str  # unique within the session; a retried append with the same id is a no-op
    role: str  # user / assistant / system / developer
    content: str
    seq: int = -1  # position in the session, assigned by the store
    status: str = "completed"  # completed, or incomplete (cancelled / client disconnected)
    response_id: str | None = None  # the Responses API object this turn belongs to
    created_s: float = field(default_factory=time.time)
    token_ids: list[int] | None = None  # an answer's generated ids (exact KV reuse next turn)
    model: str | None = None  # whose tokenizer `token_ids` belong to

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Turn":
        return cls(**json.loads(text))


@dataclass
class SessionInfo:
    session_id: str
    created_s: float
    metadata: dict = field(default_factory=dict)


@dataclass
class StoreConfig:
    url: str  # sqlite:///path/to.db or redis://host:port/db
    ttl_s: float = DEFAULT_TTL_S
    max_sessions_per_tenant: int = DEFAULT_MAX_SESSIONS_PER_TENANT
    timeout_s: float = 2.0  # per backend call: a slow store fails the request, never hangs it


class SessionStore:
    """The interface both backends implement (all coroutine methods)."""

    config: StoreConfig

    async def create(self, tenant: str, session_id: str, metadata: dict | None = None) -> SessionInfo:
        """Create the session, or return it if it exists (creation is idempotent too)."""
        raise NotImplementedError

    async def get(self, tenant: str, session_id: str) -> SessionInfo | None:
        raise NotImplementedError

    async def turns(self, tenant: str, session_id: str, upto_seq: int | None = None) -> list[Turn]:
        """The session's turns in seq order (those with seq <= upto_seq if given)."""
        raise NotImplementedError

    async def append(self, tenant: str, session_id: str, turn: Turn,
                     expect_seq: int | None = None) -> Turn:
        """Store `turn` at the next seq; if its turn_id is already stored, return that turn.

        KeyError: no such session. SeqConflict: `expect_seq` given and the next seq differs."""
        raise NotImplementedError

    async def delete(self, tenant: str, session_id: str) -> bool:
        raise NotImplementedError

    async def put_response(self, tenant: str, response_id: str, body: dict) -> None:
        raise NotImplementedError

    async def get_response(self, tenant: str, response_id: str) -> dict | None:
        raise NotImplementedError

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        raise NotImplementedError

    async def ping(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


def open_store(url: str, ttl_s: float = DEFAULT_TTL_S,
               max_sessions_per_tenant: int = DEFAULT_MAX_SESSIONS_PER_TENANT) -> SessionStore:
    config = StoreConfig(url, ttl_s, max_sessions_per_tenant)
    scheme = urlparse(url).scheme
    if scheme == "sqlite":
        return SQLiteStore(config)
    if scheme in ("redis", "rediss", "unix"):
        return RedisStore(config)
    raise ValueError(f"session store URL must be sqlite:///path or redis://host:port/db, "
                     f"not {url!r}")


# ---- SQLite ---------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
  tenant TEXT NOT NULL, session_id TEXT NOT NULL, created_s REAL NOT NULL,
  updated_s REAL NOT NULL, metadata TEXT NOT NULL, PRIMARY KEY (tenant, session_id));
CREATE TABLE IF NOT EXISTS turns (
  tenant TEXT NOT NULL, session_id TEXT NOT NULL, seq INTEGER NOT NULL, turn_id TEXT NOT NULL,
  body TEXT NOT NULL, PRIMARY KEY (tenant, session_id, seq),
  UNIQUE (tenant, session_id, turn_id));
CREATE TABLE IF NOT EXISTS responses (
  tenant TEXT NOT NULL, response_id TEXT NOT NULL, updated_s REAL NOT NULL, body TEXT NOT NULL,
  PRIMARY KEY (tenant, response_id));
"""


class SQLiteStore(SessionStore):
    """One connection on one dedicated thread (sqlite3 objects stay on their thread); WAL with
    synchronous=FULL, so an acknowledged turn survives a crash of the process."""

    def __init__(self, config: StoreConfig):
        self.config = config
        path = urlparse(config.url).path
        self.path = Path(path[1:] if path.startswith("//") else path)  # sqlite:////abs -> /abs
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ultrafast-sqlite")
        self._db: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(str(self.path), timeout=self.config.timeout_s,
                                 isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    async def _run(self, fn, *args):
        def call():
            db = self._connect()
            try:
                db.execute("BEGIN IMMEDIATE")
                result = fn(db, *args)
                db.execute("COMMIT")
                return result
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, call)
        except (sqlite3.Error, OSError) as exc:  # locked, disk full, unwritable directory
            raise StoreUnavailable(f"sqlite: {exc}") from exc

    def _expire(self, db: sqlite3.Connection, tenant: str) -> None:
        cutoff = time.time() - self.config.ttl_s
        for (sid,) in db.execute("SELECT session_id FROM sessions WHERE tenant=? AND updated_s<?",
                                 (tenant, cutoff)).fetchall():
            self._delete(db, tenant, sid)
        db.execute("DELETE FROM responses WHERE tenant=? AND updated_s<?", (tenant, cutoff))

    def _live(self, db, tenant: str, session_id: str):
        row = db.execute("SELECT created_s, updated_s, metadata FROM sessions WHERE tenant=? AND "
                         "session_id=?", (tenant, session_id)).fetchone()
        if row is None or row[1] < time.time() - self.config.ttl_s:
            return None
        return SessionInfo(session_id, row[0], json.loads(row[2]))

    async def create(self, tenant, session_id, metadata=None):
        def create(db):
            info = self._live(db, tenant, session_id)
            if info is not None:
                return info
            self._expire(db, tenant)
            (count,) = db.execute("SELECT COUNT(*) FROM sessions WHERE tenant=?",
                                  (tenant,)).fetchone()
            if count >= self.config.max_sessions_per_tenant:
                raise TooManySessions()
            now = time.time()
            db.execute("INSERT INTO sessions VALUES (?,?,?,?,?)",
                       (tenant, session_id, now, now, json.dumps(metadata or {})))
            return SessionInfo(session_id, now, metadata or {})
        return await self._run(create)

    async def get(self, tenant, session_id):
        return await self._run(lambda db: self._live(db, tenant, session_id))

    async def turns(self, tenant, session_id, upto_seq=None):
        def turns(db):
            if self._live(db, tenant, session_id) is None:
                return []
            rows = db.execute("SELECT body FROM turns WHERE tenant=? AND session_id=? AND seq<=? "
                              "ORDER BY seq", (tenant, session_id,
                                               2 ** 62 if upto_seq is None else upto_seq))
            return [Turn.from_json(body) for (body,) in rows.fetchall()]
        return await self._run(turns)

    async def append(self, tenant, session_id, turn, expect_seq=None):
        def append(db):
            row = db.execute("SELECT body FROM turns WHERE tenant=? AND session_id=? AND "
                             "turn_id=?", (tenant, session_id, turn.turn_id)).fetchone()
            if row is not None:
                return Turn.from_json(row[0])
            if self._live(db, tenant, session_id) is None:
                raise KeyError(session_id)
            (seq,) = db.execute("SELECT COUNT(*) FROM turns WHERE tenant=? AND session_id=?",
                                (tenant, session_id)).fetchone()
            if expect_seq is not None and seq != expect_seq:
                raise SeqConflict()
            stored = Turn(**{**asdict(turn), "seq": seq})
            db.execute("INSERT INTO turns VALUES (?,?,?,?,?)",
                       (tenant, session_id, seq, turn.turn_id, stored.to_json()))
            db.execute("UPDATE sessions SET updated_s=? WHERE tenant=? AND session_id=?",
                       (time.time(), tenant, session_id))
            return stored
        return await self._run(append)

    def _delete(self, db, tenant: str, session_id: str) -> bool:
        db.execute("DELETE FROM turns WHERE tenant=? AND session_id=?", (tenant, session_id))
        return db.execute("DELETE FROM sessions WHERE tenant=? AND session_id=?",
                          (tenant, session_id)).rowcount > 0

    async def delete(self, tenant, session_id):
        return await self._run(self._delete, tenant, session_id)

    async def put_response(self, tenant, response_id, body):
        await self._run(lambda db: db.execute(
            "INSERT OR REPLACE INTO responses VALUES (?,?,?,?)",
            (tenant, response_id, time.time(), json.dumps(body))))

    async def get_response(self, tenant, response_id):
        def get(db):
            row = db.execute("SELECT body, updated_s FROM responses WHERE tenant=? AND "
                             "response_id=?", (tenant, response_id)).fetchone()
            if row is None or row[1] < time.time() - self.config.ttl_s:
                return None
            return json.loads(row[0])
        return await self._run(get)

    async def delete_response(self, tenant, response_id):
        return await self._run(lambda db: db.execute(
            "DELETE FROM responses WHERE tenant=? AND response_id=?",
            (tenant, response_id)).rowcount > 0)

    async def ping(self):
        await self._run(lambda db: db.execute("SELECT 1").fetchone())

    async def close(self):
        def close():
            if self._db is not None:
                self._db.close()
                self._db = None
        await asyncio.get_running_loop().run_in_executor(self._thread, close)
        self._thread.shutdown(wait=True)


# ---- Redis ----------------------------------------------------------------------------------

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

        self.config = config
        self._errors = (aioredis.RedisError, OSError, asyncio.TimeoutError)
        # A pooled connection that a Redis restart or a link reset killed fails on its next
        # write; retry such a call on a fresh connection (every write is an idempotent script,
        # so a retry never duplicates a turn). Timeouts are not retried: the deadline holds.
        self._redis = aioredis.Redis.from_url(
            config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s,
            max_connections=64, health_check_interval=5,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 3,
                        supported_errors=(RedisConnectionError,)),
            retry_on_error=[RedisConnectionError])
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
        full, body = await self._call(self._create(
            keys=[meta_key, index], args=[meta, self._ttl_ms, now, now - self.config.ttl_s,
                                          self.config.max_sessions_per_tenant]))
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
        seq, stored = await self._call(self._append(
            keys=keys, args=[turn.turn_id, body, self._ttl_ms, time.time(),
                               "" if expect_seq is None else expect_seq]))
        if seq == -2:
            raise SeqConflict()
        if seq < 0:
            raise KeyError(session_id)
        return Turn.from_json(stored)

    async def delete(self, tenant, session_id):
        keys = self._keys(tenant, session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(*keys[:3]).zrem(keys[3], keys[0])
            deleted, _ = await self._call(pipe.execute())
        return deleted > 0

    async def put_response(self, tenant, response_id, body):
        await self._call(self._redis.set(f"t:{tenant}:r:{response_id}", json.dumps(body),
                                         px=self._ttl_ms))

    async def get_response(self, tenant, response_id):
        body = await self._call(self._redis.get(f"t:{tenant}:r:{response_id}"))
        return None if body is None else json.loads(body)

    async def delete_response(self, tenant, response_id):
        return await self._call(self._redis.delete(f"t:{tenant}:r:{response_id}")) > 0

    async def ping(self):
        await self._call(self._redis.ping())

    async def close(self):
        await self._redis.aclose()
