"""Joining a stored conversation with the client's new turn, and committing the answer back.

Used by chat completions (`session_id`), the Responses and Conversations APIs and the realtime
WebSocket. The order per turn: read the history (503 `session_store_unavailable` if the store is
down, before any generation), tokenize and admit, persist the new user turn(s), generate, then
commit the assistant turn before the stream's last event. A commit that meets a store outage is
retried with the same turn id for `commit_grace_s` (the store makes the retry idempotent, so the
turn is stored exactly once); past the grace the client is told `session_commit_failed` and the
turn keeps being retried in the background until the store is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from ultrafast.server.errors import APIError
from ultrafast.server.protocol_models import NAME_RE
from ultrafast.server.sessions import SessionStore, StoreUnavailable, TooManySessions, Turn

log = logging.getLogger(__name__)

MAX_PENDING_COMMITS = 10_000  # background re-tries held while the store is down


def tenant_of(http) -> str:
    """The tenant an auth layer put on the request (`request.state.tenant`), else the default."""
    return getattr(http.state, "tenant", "") or ""


def unavailable() -> APIError:
    return APIError(503, "the session store is unavailable; retry shortly", "server_error",
                    "session_store_unavailable", None, headers={"Retry-After": "1"})


def not_found(kind: str, param: str | None) -> APIError:
    # the same body for another tenant's id and for an id that never existed (B44)
    return APIError(404, f"{kind} not found", "not_found_error", f"{kind}_not_found", param)


def turns_to_messages(turns: list[Turn]) -> list[dict]:
    return [{"role": t.role, "content": t.content} for t in turns]


class SessionFlow:
    def __init__(self, store: SessionStore, commit_grace_s: float = 30.0):
        self.store = store
        self.commit_grace_s = commit_grace_s
        self.pending: set[asyncio.Task] = set()  # commits past their grace, still retrying

    async def call(self, method: str, *args, **kwargs):
        """A store call with its failures in the OpenAI envelope."""
        try:
            return await getattr(self.store, method)(*args, **kwargs)
        except StoreUnavailable:
            raise unavailable() from None
        except TooManySessions:
            raise APIError(429, "this tenant holds the maximum number of sessions; delete some "
                           "or let them expire", "rate_limit_error", "too_many_sessions",
                           None) from None

    async def history(self, tenant: str, session_id: str, create: bool, param: str,
                      upto_seq: int | None = None) -> list[Turn]:
        info = await self.call("get", tenant, session_id)
        if info is None:
            if not create:
                raise not_found("session" if param == "session_id" else "conversation", param)
            await self.call("create", tenant, session_id)
            return []
        return await self.call("turns", tenant, session_id, upto_seq)

    async def append_turns(self, tenant: str, session_id: str, messages: list[dict],
                           turn_id_base: str, expect_seq: int | None = None) -> list[Turn]:
        """Persist the client's new turn(s) before generating; `expect_seq` guards a branch."""
        stored = []
        for i, m in enumerate(messages):
            turn = Turn(f"{turn_id_base}-u{i}", m["role"], m["content"])
            try:
                stored.append(await self.call(
                    "append", tenant, session_id, turn,
                    expect_seq=None if expect_seq is None else expect_seq + i))
            except KeyError:
                raise not_found("session", "session_id") from None
        return stored

    async def commit(self, tenant: str, session_id: str, turn: Turn) -> Turn | None:
        """Append with retries for `commit_grace_s`: the stored turn, or None past the grace
        (the turn is then retried in the background until the store is back)."""
        deadline = time.monotonic() + self.commit_grace_s
        delay_s = 0.05
        while True:
            try:
                return await self.store.append(tenant, session_id, turn)
            except KeyError:
                return turn  # the client deleted the session meanwhile: nothing to keep
            except StoreUnavailable:
                if time.monotonic() + delay_s > deadline:
                    break
                await asyncio.sleep(delay_s)
                delay_s = min(1.0, delay_s * 2)
        if len(self.pending) < MAX_PENDING_COMMITS:
            task = asyncio.ensure_future(self._commit_later(tenant, session_id, turn))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)
        else:
            log.error("session commit dropped: %d commits already pending", len(self.pending))
        return None

    async def _commit_later(self, tenant: str, session_id: str, turn: Turn) -> None:
        while True:
            try:
                await self.store.append(tenant, session_id, turn)
                return
            except KeyError:
                return
            except StoreUnavailable:
                await asyncio.sleep(1.0)

    def assistant_hook(self, tenant: str, session_id: str, turn_id: str,
                       response_id: str | None = None, after=None):
        """GenerationRun.on_complete: store choice 0's text as the assistant turn.

        `after(run, stored_turn_or_None)` runs next (the Responses API saves its response
        object there)."""
        async def on_complete(run, reason: str | None) -> str | None:
            choice = run.choices[0]
            complete = reason is None and choice.finish_reason in ("stop", "length")
            turn = Turn(turn_id, "assistant", choice.text,
                        status="completed" if complete else "incomplete",
                        response_id=response_id)
            stored = await self.commit(tenant, session_id, turn)
            ok = stored is not None
            if after is not None:
                try:
                    await after(run, stored)
                except (StoreUnavailable, APIError):
                    ok = False
            return None if ok else "session_commit_failed"
        return on_complete

    async def branch(self, tenant: str, source_id: str, turns: list[Turn],
                     new_id: str) -> None:
        """A new session holding `turns` (a reply to an older response forks the history)."""
        await self.call("create", tenant, new_id)
        for turn in turns:
            await self.call("append", tenant, new_id, Turn(turn.turn_id, turn.role, turn.content,
                                                           status=turn.status,
                                                           response_id=turn.response_id))


@dataclass
class ChatSession:
    """A chat completion bound to `session_id`: history joined with the new messages."""

    flow: SessionFlow
    tenant: str
    session_id: str
    turn_id_base: str  # the Idempotency-Key header, else a fresh id
    new_messages: list[dict]
    messages: list[dict]  # history + new, what the template renders

    @classmethod
    async def open(cls, flow: SessionFlow, http, req) -> "ChatSession":
        if req.n != 1:
            raise APIError(400, "n must be 1 with session_id: one answer joins the history",
                           "invalid_request_error", "invalid_value", "n")
        tenant = tenant_of(http)
        key = http.headers.get("idempotency-key")
        if key is not None and not NAME_RE.fullmatch(key):
            raise APIError(400, "Idempotency-Key must match [A-Za-z0-9_-]{1,64}",
                           "invalid_request_error", "invalid_value", "Idempotency-Key")
        base = key or "chat-" + uuid.uuid4().hex
        history = await flow.history(tenant, req.session_id, create=True, param="session_id")
        # a retry whose first attempt stored the user turn: that turn is the new one, not history
        history = [t for t in history if not t.turn_id.startswith(base + "-")]
        new = req.messages_for_template()
        return cls(flow, tenant, req.session_id, base, new, turns_to_messages(history) + new)

    async def start(self, run) -> None:
        """Persist the new turn, then hook the assistant commit onto the run."""
        await self.flow.append_turns(self.tenant, self.session_id, self.new_messages,
                                     self.turn_id_base)
        run.on_complete = self.flow.assistant_hook(self.tenant, self.session_id,
                                                   f"{self.turn_id_base}-a")
