"""The embedded session store: one SQLite file, on a dedicated thread."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlparse

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

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
  tenant TEXT NOT NULL, session_id TEXT NOT NULL, created_s REAL NOT NULL,
  updated_s REAL NOT NULL, metadata TEXT NOT NULL, PRIMARY KEY (tenant, session_id));
CREATE TABLE IF NOT EXISTS turns (
  tenant TEXT NOT NULL, session_id TEXT NOT NULL, seq INTEGER NOT NULL, turn_id TEXT NOT NULL,
  body TEXT NOT NULL, PRIMARY KEY (tenant, session_id, seq),
  UNIQUE (tenant, session_id, turn_id));
CREATE TABLE IF NOT EXISTS objects (
  tenant TEXT NOT NULL, kind TEXT NOT NULL, object_id TEXT NOT NULL, created_s REAL NOT NULL,
  updated_s REAL NOT NULL, body TEXT NOT NULL, PRIMARY KEY (tenant, kind, object_id));
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
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # created 0600 (sqlite gives its -wal and -shm files the database file's mode)
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            db = sqlite3.connect(
                str(self.path),
                timeout=self.config.timeout_s,
                isolation_level=None,
                check_same_thread=False,
            )
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
        for (sid,) in db.execute(
            "SELECT session_id FROM sessions WHERE tenant=? AND updated_s<?", (tenant, cutoff)
        ).fetchall():
            self._delete(db, tenant, sid)
        db.execute("DELETE FROM objects WHERE tenant=? AND updated_s<?", (tenant, cutoff))

    def _live(self, db, tenant: str, session_id: str):
        row = db.execute(
            "SELECT created_s, updated_s, metadata FROM sessions WHERE tenant=? AND session_id=?",
            (tenant, session_id),
        ).fetchone()
        if row is None or row[1] < time.time() - self.config.ttl_s:
            return None
        return SessionInfo(session_id, row[0], json.loads(row[2]))

    async def create(self, tenant, session_id, metadata=None):
        def create(db):
            info = self._live(db, tenant, session_id)
            if info is not None:
                return info
            self._expire(db, tenant)
            (count,) = db.execute(
                "SELECT COUNT(*) FROM sessions WHERE tenant=?", (tenant,)
            ).fetchone()
            if count >= self.config.max_sessions_per_tenant:
                raise TooManySessions()
            now = time.time()
            db.execute(
                "INSERT INTO sessions VALUES (?,?,?,?,?)",
                (tenant, session_id, now, now, json.dumps(metadata or {})),
            )
            return SessionInfo(session_id, now, metadata or {})

        return await self._run(create)

    async def get(self, tenant, session_id):
        return await self._run(lambda db: self._live(db, tenant, session_id))

    async def turns(self, tenant, session_id, upto_seq=None):
        def turns(db):
            if self._live(db, tenant, session_id) is None:
                return []
            rows = db.execute(
                "SELECT body FROM turns WHERE tenant=? AND session_id=? AND seq<=? ORDER BY seq",
                (tenant, session_id, 2**62 if upto_seq is None else upto_seq),
            )
            return [Turn.from_json(body) for (body,) in rows.fetchall()]

        return await self._run(turns)

    async def append(self, tenant, session_id, turn, expect_seq=None):
        def append(db):
            row = db.execute(
                "SELECT body FROM turns WHERE tenant=? AND session_id=? AND turn_id=?",
                (tenant, session_id, turn.turn_id),
            ).fetchone()
            if row is not None:
                return Turn.from_json(row[0])
            if self._live(db, tenant, session_id) is None:
                raise KeyError(session_id)
            (seq,) = db.execute(
                "SELECT COUNT(*) FROM turns WHERE tenant=? AND session_id=?", (tenant, session_id)
            ).fetchone()
            if expect_seq is not None and seq != expect_seq:
                raise SeqConflict()
            stored = Turn(**{**asdict(turn), "seq": seq})
            db.execute(
                "INSERT INTO turns VALUES (?,?,?,?,?)",
                (tenant, session_id, seq, turn.turn_id, stored.to_json()),
            )
            db.execute(
                "UPDATE sessions SET updated_s=? WHERE tenant=? AND session_id=?",
                (time.time(), tenant, session_id),
            )
            return stored

        return await self._run(append)

    def _delete(self, db, tenant: str, session_id: str) -> bool:
        db.execute("DELETE FROM turns WHERE tenant=? AND session_id=?", (tenant, session_id))
        return (
            db.execute(
                "DELETE FROM sessions WHERE tenant=? AND session_id=?", (tenant, session_id)
            ).rowcount
            > 0
        )

    async def delete(self, tenant, session_id):
        return await self._run(self._delete, tenant, session_id)

    async def set_metadata(self, tenant, session_id, metadata):
        def update(db):
            info = self._live(db, tenant, session_id)
            if info is None:
                return None
            db.execute(
                "UPDATE sessions SET metadata=?, updated_s=? WHERE tenant=? AND session_id=?",
                (json.dumps(metadata), time.time(), tenant, session_id),
            )
            return SessionInfo(session_id, info.created_s, dict(metadata))

        return await self._run(update)

    async def put_object(self, tenant, kind, object_id, obj):
        await self._run(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO objects VALUES (?,?,?,?,?,?)",
                (tenant, kind, object_id, obj.created_s, time.time(), obj.to_json()),
            )
        )

    async def get_object(self, tenant, kind, object_id):
        def get(db):
            row = db.execute(
                "SELECT body, updated_s FROM objects WHERE tenant=? AND kind=? AND object_id=?",
                (tenant, kind, object_id),
            ).fetchone()
            if row is None or row[1] < time.time() - self.config.ttl_s:
                return None
            return StoredObject.from_json(row[0])

        return await self._run(get)

    async def delete_object(self, tenant, kind, object_id):
        return await self._run(
            lambda db: (
                db.execute(
                    "DELETE FROM objects WHERE tenant=? AND kind=? AND object_id=?",
                    (tenant, kind, object_id),
                ).rowcount
                > 0
            )
        )

    async def list_objects(self, tenant, kind):
        def list_(db):
            rows = db.execute(
                "SELECT body FROM objects WHERE tenant=? AND kind=? AND "
                "updated_s>=? ORDER BY created_s, object_id",
                (tenant, kind, time.time() - self.config.ttl_s),
            ).fetchall()
            return [StoredObject.from_json(body) for (body,) in rows]

        return await self._run(list_)

    async def ping(self):
        await self._run(lambda db: db.execute("SELECT 1").fetchone())

    async def close(self):
        def close():
            if self._db is not None:
                self._db.close()
                self._db = None

        await asyncio.get_running_loop().run_in_executor(self._thread, close)
        self._thread.shutdown(wait=True)
