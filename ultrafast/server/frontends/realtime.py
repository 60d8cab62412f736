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
Function calling (server/tools/realtime_events.py): `session.update` {session: {tools,
tool_choice, parallel_tool_calls}} (answered `session.updated`), the same fields on
`response.create`; `function_call` / `function_call_output` items in
`conversation.item.create`; each call streams as `response.output_item.added`,
`response.function_call_arguments.delta`, and `.done` + `response.output_item.done` the moment
its JSON closes.
The conversation is `?conversation=<id>` (an existing session) or a new one, named in
`session.created`. One response runs at a time per connection.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from ultrafast.server.calls import CallInput, check_options, plain_params, prepare_call
from ultrafast.server.errors import APIError, invalid_type
from ultrafast.server.frontends.conversations import InputItem
from ultrafast.server.generate import ChoiceDelta, GenerationRun
from ultrafast.server.json_body import nesting_ok
from ultrafast.server.prompt import ChatMessage
from ultrafast.server.protocol_models import NAME_RE, validate_input
from ultrafast.server.sessions.flow import (
    SessionFlow,
    assistant_turn,
    tenant_name,
    turns_to_messages,
)
from ultrafast.server.sessions.store import Turn
from ultrafast.server.state import ServerState
from ultrafast.server.tools.realtime_events import (
    TOOL_OPTIONS,
    call_events,
    function_item_created,
    function_item_turn,
    realtime_plan,
)
from ultrafast.server.tools.responses_api import call_item

MAX_MESSAGE_BYTES = 1024 * 1024


def _error(code: str, message: str, event_id: str | None = None) -> dict:
    return {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "code": code,
            "message": message,
            "param": None,
            "event_id": event_id,
        },
    }


class RealtimeConnection:
    def __init__(
        self, state: ServerState, flow: SessionFlow, ws: WebSocket, tenant: str, session_id: str
    ):
        self.state = state
        self.flow = flow
        self.ws = ws
        self.tenant = tenant
        self.session_id = session_id
        self.task: asyncio.Task | None = None  # the response being generated
        self.run: GenerationRun | None = None
        self.sent_text = ""  # what the client has actually received of the current response
        self.cancelled = False
        self.closed = False
        self.session_options: dict = {}  # session.update: tools, tool_choice, ...

    async def send(self, event: dict) -> None:
        if self.closed:
            return
        try:
            await self.ws.send_text(json.dumps(event))
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.closed = True  # the client left; generation still ends and commits

    async def handle(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "session.update":
            await self._update_session(event.get("session"))
        elif kind == "conversation.item.create":
            turn_id = "rt-" + str(event.get("event_id") or uuid.uuid4().hex)[:64]
            call_turn = function_item_turn(event.get("item"), turn_id)
            if call_turn is not None:  # a function call, or the client's result for one
                stored_call = await self.flow.append(self.tenant, self.session_id, call_turn)
                await self.send(function_item_created(stored_call))
                return
            item = validate_input(InputItem, event.get("item"))
            turn = Turn(event.get("event_id") or uuid.uuid4().hex, item.role, item.text())
            turn.turn_id = "rt-" + str(turn.turn_id)[:64]
            stored = await self.flow.append(self.tenant, self.session_id, turn)
            await self.send(
                {
                    "type": "conversation.item.created",
                    "item": {
                        "id": f"msg_{stored.turn_id}",
                        "type": "message",
                        "role": stored.role,
                        "status": stored.status,
                        "content": [{"type": "input_text", "text": stored.content}],
                    },
                }
            )
        elif kind == "response.create":
            if self.task is not None and not self.task.done():
                await self.send(
                    _error(
                        "conversation_already_has_active_response",
                        "a response is already being generated",
                    )
                )
                return
            await self._start(event.get("response") or {})
        elif kind == "response.cancel":
            await self.cancel()
        else:
            await self.send(_error("invalid_event", f"unknown event type {str(kind)[:40]!r}"))

    async def _update_session(self, session: object) -> None:
        if not isinstance(session, dict):
            raise invalid_type("session", "session must be a JSON object")
        options = {**self.session_options, **{k: session[k] for k in TOOL_OPTIONS if k in session}}
        realtime_plan(
            options, {}, self.state.models.default.limits
        )  # refuse bad tools now, not at response
        self.session_options = options
        await self.send(
            {
                "type": "session.updated",
                "session": {"id": self.session_id, "object": "realtime.session", **options},
            }
        )

    async def _start(self, options: object) -> None:
        if not isinstance(options, dict):
            raise invalid_type("response", "response must be a JSON object")
        max_tokens, temperature, top_p = (
            options.get(k) for k in ("max_output_tokens", "temperature", "top_p")
        )
        for name, value, kinds in (
            ("max_output_tokens", max_tokens, (int,)),
            ("temperature", temperature, (int, float)),
            ("top_p", top_p, (int, float)),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
                raise invalid_type(f"response.{name}", f"{name} must be a number")
        tier, auto = check_options(
            self.state.models.default.limits,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            max_tokens_param="max_output_tokens",
            service_tier=options.get("service_tier"),
        )
        turns = await self.flow.turns(self.tenant, self.session_id)
        messages = turns_to_messages(turns, self.flow.model_name)
        instructions = options.get("instructions")
        if isinstance(instructions, str) and instructions:
            messages = [ChatMessage("system", instructions)] + messages
        if not messages:
            raise APIError(
                400,
                "the conversation is empty: create an item first",
                "invalid_request_error",
                "invalid_value",
                None,
            )
        response_id = "resp_" + uuid.uuid4().hex
        tools = realtime_plan(self.session_options, options, self.state.models.default.limits)
        run = await prepare_call(
            self.state,
            self.ws.scope,
            CallInput(
                chat=True,
                params=plain_params(temperature, top_p, self.state.models.default.limits),
                max_tokens=max_tokens,
                messages=messages,
                stream=True,
                tier=tier,
                auto_tier=auto,
                request_id=response_id,
                tools=tools,
                prompt_param="conversation",
                max_tokens_param="max_output_tokens",
            ),
        )
        self.run = run
        self.sent_text, self.cancelled = "", False
        self.task = asyncio.ensure_future(self._generate(run, response_id))

    async def _generate(self, run: GenerationRun, response_id: str) -> None:
        run.start()
        try:
            await self.send(
                {
                    "type": "response.created",
                    "response": {
                        "id": response_id,
                        "object": "realtime.response",
                        "status": "in_progress",
                        "output": [],
                    },
                }
            )
            async for event in run.events():
                if self.cancelled:
                    break
                if isinstance(event, ChoiceDelta):
                    if event.text:
                        await self.send(
                            {
                                "type": "response.output_text.delta",
                                "response_id": response_id,
                                "delta": event.text,
                            }
                        )
                        self.sent_text += event.text
                    for call_event in call_events(response_id, event.tool_events, 1):
                        await self.send(call_event)  # each call whole at its close
                    if event.finish == "error":
                        break
        finally:
            run.finish()
        choice = run.choices[0]
        status = (
            "cancelled"
            if self.cancelled
            else "failed"
            if choice.error
            else "completed"
            if choice.finish_reason in ("stop", "length", "tool_calls")
            else "incomplete"
        )
        # barge-in keeps only what the client received; otherwise the whole answer
        text = self.sent_text if self.cancelled else choice.text
        turn = assistant_turn(run, f"{response_id}-a", text, status == "completed", response_id)
        stored = await self.flow.commit(self.tenant, self.session_id, turn)
        await self.send(
            {
                "type": "response.done",
                "response": {
                    "id": response_id,
                    "object": "realtime.response",
                    "status": status,
                    "output": [
                        {
                            "type": "message",
                            "role": "assistant",
                            "status": turn.status,
                            "content": [{"type": "output_text", "text": text}],
                        }
                    ]
                    + [call_item(c, turn.status) for c in turn.tool_calls or ()],
                    "usage": run.usage(),
                    "stored": stored is not None,
                },
            }
        )

    async def cancel(self) -> None:
        """Barge-in: abort the engine request now; the delta loop stops before sending more."""
        if self.task is None or self.task.done() or self.run is None:
            return
        self.cancelled = True
        self.run.generation.interrupt()  # aborts, and ends the loop's wait at once
        await self.task

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            await self.cancel()


async def _open_session(flow: SessionFlow, ws: WebSocket, tenant: str) -> str | None:
    conversation_id = ws.query_params.get("conversation")
    if conversation_id is None:
        conversation_id = "conv_" + uuid.uuid4().hex
        await flow.create(tenant, conversation_id)
    elif not NAME_RE.fullmatch(conversation_id) or await flow.get(tenant, conversation_id) is None:
        await ws.send_text(json.dumps(_error("conversation_not_found", "conversation not found")))
        await ws.close(code=1008)
        return None
    return conversation_id


def realtime_routes(state: ServerState) -> list[WebSocketRoute]:
    flow = state.sessions
    assert flow is not None

    async def realtime(ws: WebSocket) -> None:
        await ws.accept()
        tenant = tenant_name(ws)
        try:
            session_id = await _open_session(flow, ws, tenant)
        except APIError as exc:
            await ws.send_text(json.dumps(_error(exc.code or "error", exc.message)))
            await ws.close(code=1011)
            return
        if session_id is None:
            return
        conn = RealtimeConnection(state, flow, ws, tenant, session_id)
        await conn.send(
            {
                "type": "session.created",
                "session": {
                    "id": session_id,
                    "object": "realtime.session",
                    "model": state.model_name,
                    "conversation": session_id,
                },
            }
        )
        try:
            while True:
                raw = await ws.receive_text()
                try:
                    event = (
                        json.loads(raw)
                        if len(raw) <= MAX_MESSAGE_BYTES and nesting_ok(raw.encode())
                        else None
                    )
                except (json.JSONDecodeError, RecursionError):
                    event = None
                if not isinstance(event, dict):
                    await conn.send(
                        _error(
                            "invalid_json",
                            "each message must be a JSON object"
                            f" of at most {MAX_MESSAGE_BYTES} bytes",
                        )
                    )
                    continue
                try:
                    await conn.handle(event)
                except APIError as exc:
                    await conn.send(_error(exc.code or "error", exc.message, event.get("event_id")))
        except WebSocketDisconnect:
            pass
        finally:
            await conn.close()

    return [WebSocketRoute("/v1/realtime", realtime)]
