"""OpenAI's Responses API: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`.

The client sends only its new `input`; the history comes from the session store, found through
`previous_response_id` (the chain of stored responses) or `conversation` (a Conversations API
id). `instructions` apply to this call only, as in OpenAI's API, and are never stored. A stored
response records the session and the seq of its answer, so a reply to an older response forks
the history (a new session holding the turns up to it) instead of mixing two branches.
Generation reuses the chat path (template, admission, engine); only the output shape and the
stream's event names (`response.created` ... `response.completed`) differ.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal, Optional, Union

import orjson
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ultrafast.server.chat_tokens import public_messages
from ultrafast.server.conversations_api import (InputItem, _Strict, check_metadata,
                                                conversations_routes, items_to_messages,
                                                new_conversation_id, validate)
from ultrafast.server.errors import APIError, invalid_value
from ultrafast.server.protocol import parse_chat_request
from ultrafast.server.protocol_models import NAME_RE
from ultrafast.server.session_flow import not_found, tenant_of, turns_to_messages
from ultrafast.server.sessions import SeqConflict

_CHAT_PARAM = {"max_tokens": "max_output_tokens", "messages": "input"}


class ConversationRef(_Strict):
    id: str


class ResponsesRequest(_Strict):
    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Union[str, ConversationRef]] = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    service_tier: Any = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None
    parallel_tool_calls: Optional[bool] = None

    def conversation_id(self) -> str | None:
        c = self.conversation
        return c.id if isinstance(c, ConversationRef) else c

    def new_messages(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input)


def _usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens":
                                     chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


class ResponseBuilder:
    """The response object and its stream events, for one call."""

    def __init__(self, response_id: str, req: ResponsesRequest, model: str, tier: str):
        self.response_id = response_id
        self.item_id = "msg_" + response_id.removeprefix("resp_")
        self.req = req
        self.model = model
        self.tier = tier
        self.created_s = time.time()
        self.sequence_number = 0

    def body(self, status: str, text: str = "", usage: dict | None = None,
             finish_reason: str | None = None) -> dict:
        output = []
        if status != "in_progress":
            output = [self.message_item("completed" if status == "completed" else "incomplete",
                                        text)]
        conversation_id = self.req.conversation_id()
        return {
            "id": self.response_id, "object": "response", "created_at": int(self.created_s),
            "status": status, "model": self.model, "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if finish_reason == "length" else None,
            "instructions": self.req.instructions, "metadata": self.req.metadata or {},
            "previous_response_id": self.req.previous_response_id,
            "conversation": {"id": conversation_id} if conversation_id else None,
            "store": self.req.store, "max_output_tokens": self.req.max_output_tokens,
            "temperature": self.req.temperature, "top_p": self.req.top_p,
            "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "service_tier": self.tier, "user": self.req.user,
            "usage": _usage(usage) if usage else None}

    def message_item(self, status: str, text: str | None) -> dict:
        content = [] if text is None else [self.text_part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, name: str, **fields) -> bytes:
        payload = {"type": name, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def where(self) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}


async def _resolve_history(flow, tenant: str, req: ResponsesRequest):
    """(session id or None, history turns, expected next seq) for this call."""
    if req.previous_response_id is not None and req.conversation is not None:
        raise invalid_value("conversation", "send previous_response_id or conversation, not "
                            "both")
    if req.previous_response_id is not None:
        prev = None
        if NAME_RE.fullmatch(req.previous_response_id):
            prev = await flow.call("get_response", tenant, req.previous_response_id)
        if prev is None or prev.get("_session") is None:
            raise not_found("previous_response", "previous_response_id")
        session_id, upto = prev["_session"], prev["_seq"]
        turns = await flow.call("turns", tenant, session_id, upto)
        return session_id, turns, len(turns)
    conversation_id = req.conversation_id()
    if conversation_id is not None:
        if not NAME_RE.fullmatch(conversation_id):
            raise not_found("conversation", "conversation")
        turns = await flow.history(tenant, conversation_id, create=False, param="conversation")
        return conversation_id, turns, None
    if not req.store:
        return None, [], None
    session_id = "conv_" + uuid.uuid4().hex  # the chain's own session, never shown
    await flow.call("create", tenant, session_id)
    return session_id, [], 0


def _chat_request(req: ResponsesRequest, messages: list[dict], limits):
    chat_body = {"model": req.model, "messages": public_messages(messages),
                 "max_tokens": req.max_output_tokens,
                 "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
                 "service_tier": req.service_tier, "user": req.user}
    try:
        return parse_chat_request(chat_body, limits)
    except APIError as exc:
        if exc.param:
            head = exc.param.split("[")[0].split(".")[0]
            exc.param = _CHAT_PARAM.get(head, exc.param)
        raise


def responses_routes(state) -> list[Route]:
    from ultrafast.server.app import prepare_run, read_json  # app imports this module lazily

    flow = state.sessions

    async def create(http: HTTPRequest) -> Response:
        req = validate(ResponsesRequest, await read_json(http, state))
        check_metadata(req.metadata)
        tenant = tenant_of(http)
        response_id = "resp_" + uuid.uuid4().hex
        new = req.new_messages()
        session_id, turns, expect_seq = await _resolve_history(flow, tenant, req)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        messages = system + turns_to_messages(turns, flow.model_name) + new
        chat_req = _chat_request(req, messages, state.limits)
        run = await prepare_run(http, state, chat_req, True, messages, request_id=response_id)
        builder = ResponseBuilder(response_id, req, state.model_name, run.spec.tier.api_name)
        try:
            if session_id is not None and req.store:
                session_id = await _store_input(flow, tenant, session_id, turns, new,
                                                response_id, expect_seq)
                run.on_complete = flow.assistant_hook(
                    tenant, session_id, f"{response_id}-a", response_id,
                    after=_saver(flow, tenant, session_id, builder))
        except BaseException:
            run.finish()
            raise
        if req.stream:
            return StreamingResponse(_stream(run, builder), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache",
                                              "x-request-id": response_id})
        return await _respond_json(http, run, builder)

    async def get(http: HTTPRequest) -> Response:
        response_id = http.path_params["response_id"]
        body = None
        if NAME_RE.fullmatch(response_id):
            body = await flow.call("get_response", tenant_of(http), response_id)
        if body is None:
            raise not_found("response", None)
        return JSONResponse({k: v for k, v in body.items() if not k.startswith("_")})

    async def delete(http: HTTPRequest) -> Response:
        response_id = http.path_params["response_id"]
        if not NAME_RE.fullmatch(response_id) or not await flow.call(
                "delete_response", tenant_of(http), response_id):
            raise not_found("response", None)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", get, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
        *conversations_routes(state, read_json),
    ]


async def _store_input(flow, tenant: str, session_id: str, turns, new: list[dict],
                       response_id: str, expect_seq: int | None) -> str:
    """Persist the input; a reply to a response that is no longer the tip forks the session."""
    try:
        await flow.append_turns(tenant, session_id, new, response_id, expect_seq)
        return session_id
    except SeqConflict:
        fork_id = new_conversation_id()
        await flow.branch(tenant, session_id, turns, fork_id)
        await flow.append_turns(tenant, fork_id, new, response_id, len(turns))
        return fork_id


def _saver(flow, tenant: str, session_id: str, builder: ResponseBuilder):
    async def save(run, stored_turn) -> None:
        choice = run.choices[0]
        status = "completed" if choice.finish_reason == "stop" else "incomplete"
        body = builder.body(status, choice.text, run.usage(), choice.finish_reason)
        if stored_turn is not None:
            body["_session"], body["_seq"] = session_id, stored_turn.seq
        await flow.store.put_response(tenant, builder.response_id, body)
    return save


def _final_status(run) -> str:
    return "completed" if run.choices[0].finish_reason == "stop" else "incomplete"


async def _respond_json(http: HTTPRequest, run, builder: ResponseBuilder) -> Response:
    run.start()
    try:
        collect = asyncio.ensure_future(_drain(run))
        while not collect.done():
            done, _ = await asyncio.wait({collect}, timeout=0.25)
            if not done and await http.is_disconnected():
                collect.cancel()
                return Response(status_code=499)
        collect.result()
        choice = run.choices[0]
        if choice.error:
            raise APIError(500, "the engine failed while generating", "server_error",
                           "engine_error", None)
        failed = await run.complete()
    finally:
        run.finish()
    if failed:
        raise APIError(503, "the answer could not be stored in the session store",
                       "server_error", failed, None, headers={"Retry-After": "1"})
    return JSONResponse(builder.body(_final_status(run), choice.text, run.usage(),
                                     choice.finish_reason), headers=run.timing_headers())


async def _drain(run) -> None:
    async for _ in run._outputs():
        pass


async def _stream(run, b: ResponseBuilder):
    run.start()
    try:
        yield b.event("response.created", response=b.body("in_progress"))
        yield b.event("response.in_progress", response=b.body("in_progress"))
        yield b.event("response.output_item.added", output_index=0,
                      item=b.message_item("in_progress", None))
        yield b.event("response.content_part.added", part=b.text_part(""), **b.where())
        async for index, text, _, finish in run._outputs():
            if index < 0:
                yield b": ping\n\n"
            elif finish == "error":
                body = b.body("failed")
                body["error"] = {"code": "server_error", "message": "the engine failed"}
                yield b.event("response.failed", response=body)
                return
            elif text:
                yield b.event("response.output_text.delta", delta=text, logprobs=[],
                              **b.where())
        choice = run.choices[0]
        failed = await run.complete()
        status = _final_status(run)
        yield b.event("response.output_text.done", text=choice.text, logprobs=[], **b.where())
        yield b.event("response.content_part.done", part=b.text_part(choice.text), **b.where())
        yield b.event("response.output_item.done", output_index=0,
                      item=b.message_item(status, choice.text))
        body = b.body(status, choice.text, run.usage(), choice.finish_reason)
        if failed:
            body["error"] = {"code": failed, "message": "the answer could not be stored"}
        yield b.event("response.completed" if status == "completed" else "response.incomplete",
                      response=body)
    finally:
        run.finish()
