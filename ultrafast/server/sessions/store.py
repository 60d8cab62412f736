"""Session store: the server-side history of conversations, SQLite (embedded default) or Redis.

One async interface, two backends. A session (OpenAI: a conversation) belongs to one tenant and
holds turns; each turn has a `turn_id` (the idempotency key: appending an id that is already in
the session returns the stored turn, so a retried append after a lost reply never duplicates)
and a `seq` (0, 1, 2, ... in append order, assigned atomically by the store). Stored API
objects (a Response, a chat completion with `store: true`) are `StoredObject`s: the public body
exactly as GET returns it, with the store's own fields beside it (a Response's session and the
seq its answer ends at), never inside it.

Sessions expire `ttl_s` after their last write; each tenant holds at most
`max_sessions_per_tenant` live sessions (creating one more is refused, never silently evicting a
client's data). Every backend failure is raised as `StoreUnavailable`, which the routes answer
with 503 `session_store_unavailable`; nothing here blocks the event loop (SQLite runs on its own
thread, Redis through redis-py's asyncio client). Never imports torch (DESIGN rule 1).
The backends: sessions/sqlite.py, sessions/redis.py (`open_store` in sessions/backends.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from ultrafast.config import MAX_SESSIONS_PER_TENANT, SESSION_TTL_S

DEFAULT_TTL_S = SESSION_TTL_S  # the one default lives in config.py
DEFAULT_MAX_SESSIONS_PER_TENANT = MAX_SESSIONS_PER_TENANT


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
    # function calling (server/tools/): an assistant turn's calls (chat `tool_calls` shape),
    # and a tool turn's call id; rows stored before these existed read back as None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def tool_extra(self) -> dict:
        """The template fields of a tool turn or of an assistant turn that called tools."""
        extra: dict = {}
        if self.tool_calls:
            extra["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            extra["tool_call_id"] = self.tool_call_id
        return extra

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Turn:
        return cls(**json.loads(text))


# kinds of stored objects
RESPONSE, CHAT_COMPLETION = "response", "chat.completion"


@dataclass
class StoredObject:
    """A stored API object and the store's bookkeeping beside it."""

    body: dict  # the public object, as GET returns it
    created_s: float = field(default_factory=time.time)
    session_id: str | None = None  # a Response: the session holding its history
    seq: int | None = None  # ... and the seq of its answer there (a reply forks after it)
    metadata: dict = field(default_factory=dict)  # what list filters match (chat completions)
    messages: list[dict] = field(default_factory=list)  # a chat completion's request messages

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredObject:
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
    ca_file: str | None = None  # verifies a rediss:// server (redis_conn.py)


class SessionStore:
    """The interface both backends implement (all coroutine methods)."""

    config: StoreConfig

    async def create(
        self, tenant: str, session_id: str, metadata: dict | None = None
    ) -> SessionInfo:
        """Create the session, or return it if it exists (creation is idempotent too)."""
        raise NotImplementedError

    async def get(self, tenant: str, session_id: str) -> SessionInfo | None:
        raise NotImplementedError

    async def turns(self, tenant: str, session_id: str, upto_seq: int | None = None) -> list[Turn]:
        """The session's turns in seq order (those with seq <= upto_seq if given)."""
        raise NotImplementedError

    async def append(
        self, tenant: str, session_id: str, turn: Turn, expect_seq: int | None = None
    ) -> Turn:
        """Store `turn` at the next seq; if its turn_id is already stored, return that turn.

        KeyError: no such session. SeqConflict: `expect_seq` given and the next seq differs."""
        raise NotImplementedError

    async def delete(self, tenant: str, session_id: str) -> bool:
        raise NotImplementedError

    async def set_metadata(
        self, tenant: str, session_id: str, metadata: dict
    ) -> SessionInfo | None:
        """Replace the session's metadata; None: no such session."""
        raise NotImplementedError

    async def put_object(self, tenant: str, kind: str, object_id: str, obj: StoredObject) -> None:
        """Store (or replace) an API object; it expires `ttl_s` after this write."""
        raise NotImplementedError

    async def get_object(self, tenant: str, kind: str, object_id: str) -> StoredObject | None:
        raise NotImplementedError

    async def delete_object(self, tenant: str, kind: str, object_id: str) -> bool:
        raise NotImplementedError

    async def list_objects(self, tenant: str, kind: str) -> list[StoredObject]:
        """The tenant's live objects of `kind`, oldest first."""
        raise NotImplementedError

    async def ping(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass
