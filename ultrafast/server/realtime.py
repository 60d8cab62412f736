"""`/v1/realtime`: one WebSocket per conversation, text turns, server-streamed deltas, barge-in.

Events follow OpenAI's Realtime API (text subset). Client -> server:
  `conversation.item.create` {item: a message item}: stored as a turn (acknowledged with
      `conversation.item.created` once persisted);
  `response.create` {response?: {max_output_tokens, temperature, top_p, instructions}}:
      generate the assistant turn from the stored history;
  `response.cancel`: barge-in. Generation stops at once (the engine request is aborted), and
      only the text already sent to the client is stored, as an `incomplete` turn.
Server -> client: `session.created`, `conversation.item.created`, `response.created`,
`response.output_text.delta`, `response.done` {response: {status, output, usage}}, `error`.
The conversation is `?conversation=<id>` (an existing session) or a new one, named in
`session.created`. One response runs at a time per connection.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from ultrafast.server.chat_tokens import answer_token_ids, public_messages
from ultrafast.server.conversations_api import InputItem, items_to_messages, validate
from ultrafast.server.errors import APIError
from ultrafast.server.protocol import parse_chat_request
from ultrafast.server.protocol_models import NAME_RE
from ultrafast.server.session_flow import tenant_of, turns_to_messages
from ultrafast.server.sessions import Turn

MAX_MESSAGE_BYTES = 1024 * 1024


def _error(code: str, message: str, event_id: str | None = None) -> dict:
    return {"type": "error", "error": {"type": "invalid_request_error", "code": code,
                                       "message": message, "param": None,
                                       "event_id": event_id}}


class RealtimeConnection:
    def __init__(self, state, ws: WebSocket, tenant: str, session_id: str):
        self.state = state
        self.flow = state.sessions
        self.ws = ws
        self.tenant = tenant
        self.session_id = session_id
        self.task: asyncio.Task | None = None  # the response being generated
        self.run = None
        self.sent_text = ""  # what the client has actually received of the current response
        self.cancelled = False
        self.closed = False

    async def send(self, event: dict) -> None:
        if self.closed:
            return
        try:
            await self.ws.send_text(json.dumps(event))
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.closed = True  # the client left; generation still ends and commits

    async def handle(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "conversation.item.create":
            item = validate(InputItem, event.get("item"))
            turn = Turn(event.get("event_id") or uuid.uuid4().hex, item.role, item.text())
            turn.turn_id = "rt-" + str(turn.turn_id)[:64]
            stored = await self.flow.call("append", self.tenant, self.session_id, turn)
            await self.send({"type": "conversation.item.created",
                             "item": {"id": f"msg_{stored.turn_id}", "type": "message",
                                      "role": stored.role, "status": stored.status,
                                      "content": [{"type": "input_text",
                                                   "text": stored.content}]}})
        elif kind == "response.create":
            if self.task is not None and not self.task.done():
                await self.send(_error("conversation_already_has_active_response",
                                       "a response is already being generated"))
                return
            await self._start(event.get("response") or {})
        elif kind == "response.cancel":
            await self.cancel()
        else:
            await self.send(_error("invalid_event", f"unknown event type {str(kind)[:40]!r}"))

    async def _start(self, options: dict) -> None:
        from ultrafast.server.app import prepare_run

        turns = await self.flow.call("turns", self.tenant, self.session_id)
        messages = turns_to_messages(turns, self.flow.model_name)
        if options.get("instructions"):
            messages = [{"role": "system", "content": options["instructions"]}] + messages
        if not messages:
            raise APIError(400, "the conversation is empty: create an item first",
                           "invalid_request_error", "invalid_value", None)
        req = parse_chat_request({"messages": public_messages(messages), "stream": True,
                                  "max_tokens": options.get("max_output_tokens"),
                                  "temperature": options.get("temperature"),
                                  "top_p": options.get("top_p"),
                                  "service_tier": options.get("service_tier")},
                                 self.state.limits)
        response_id = "resp_" + uuid.uuid4().hex
        self.run = await prepare_run(self.ws, self.state, req, True, messages,
                                     request_id=response_id)
        self.sent_text, self.cancelled = "", False
        self.task = asyncio.ensure_future(self._generate(self.run, response_id))

    async def _generate(self, run, response_id: str) -> None:
        run.start()
        try:
            await self.send({"type": "response.created",
                             "response": {"id": response_id, "object": "realtime.response",
                                          "status": "in_progress", "output": []}})
            async for index, text, _, finish in run._outputs():
                if self.cancelled:
                    break
                if index >= 0 and text:
                    await self.send({"type": "response.output_text.delta",
                                     "response_id": response_id, "delta": text})
                    self.sent_text += text
                if finish == "error":
                    break
        finally:
            run.finish()
        choice = run.choices[0]
        status = ("cancelled" if self.cancelled else "failed" if choice.error else
                  "completed" if choice.finish_reason in ("stop", "length") else "incomplete")
        # barge-in keeps only what the client received; otherwise the whole answer
        text = self.sent_text if self.cancelled else choice.text
        turn = Turn(f"{response_id}-a", "assistant", text,
                    status="completed" if status == "completed" else "incomplete",
                    response_id=response_id, model=run.spec.model_name,
                    token_ids=answer_token_ids(self.state.tokenizer, choice.token_ids, text))
        stored = await self.flow.commit(self.tenant, self.session_id, turn)
        await self.send({"type": "response.done", "response": {
            "id": response_id, "object": "realtime.response", "status": status,
            "output": [{"type": "message", "role": "assistant", "status": turn.status,
                        "content": [{"type": "output_text", "text": text}]}],
            "usage": run.usage(),
            "stored": stored is not None}})

    async def cancel(self) -> None:
        """Barge-in: abort the engine request now; the delta loop stops before sending more."""
        if self.task is None or self.task.done():
            return
        self.cancelled = True
        self.run.generation.abort_all()
        self.run.generation.queue.put_nowait(_WAKE)  # end the loop's wait at once
        await self.task

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            await self.cancel()


class _Wake:
    """A non-output put on a generation's queue so a waiting loop sees `cancelled` at once."""

    request_id = None
    finished = False
    new_token_ids: list = []


_WAKE = _Wake()


async def _open_session(state, ws: WebSocket, tenant: str) -> str | None:
    conversation_id = ws.query_params.get("conversation")
    flow = state.sessions
    if conversation_id is None:
        conversation_id = "conv_" + uuid.uuid4().hex
        await flow.call("create", tenant, conversation_id)
    elif not NAME_RE.fullmatch(conversation_id) or await flow.call(
            "get", tenant, conversation_id) is None:
        await ws.send_text(json.dumps(_error("conversation_not_found", "conversation not found")))
        await ws.close(code=1008)
        return None
    return conversation_id


def realtime_routes(state) -> list[WebSocketRoute]:
    async def realtime(ws: WebSocket) -> None:
        await ws.accept()
        tenant = tenant_of(ws)
        try:
            session_id = await _open_session(state, ws, tenant)
        except APIError as exc:
            await ws.send_text(json.dumps(_error(exc.code or "error", exc.message)))
            await ws.close(code=1011)
            return
        if session_id is None:
            return
        conn = RealtimeConnection(state, ws, tenant, session_id)
        await conn.send({"type": "session.created",
                         "session": {"id": session_id, "object": "realtime.session",
                                     "model": state.model_name, "conversation": session_id}})
        try:
            while True:
                raw = await ws.receive_text()
                try:
                    event = json.loads(raw) if len(raw) <= MAX_MESSAGE_BYTES else None
                except json.JSONDecodeError:
                    event = None
                if not isinstance(event, dict):
                    await conn.send(_error("invalid_json", "each message must be a JSON object"
                                           f" of at most {MAX_MESSAGE_BYTES} bytes"))
                    continue
                try:
                    await conn.handle(event)
                except APIError as exc:
                    await conn.send(_error(exc.code or "error", exc.message,
                                           event.get("event_id")))
        except WebSocketDisconnect:
            pass
        finally:
            await conn.close()

    return [WebSocketRoute("/v1/realtime", realtime)]
