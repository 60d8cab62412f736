"""OpenAI's Responses API: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`.

The client sends only its new `input`; the history comes from the session store, found through
`previous_response_id` (the chain of stored responses) or `conversation` (a Conversations API
id). `instructions` apply to this call only, as in OpenAI's API, and are never stored. A stored
response records the session and the seq of its answer beside its body (never in it), so a
reply to an older response forks the history (a new session holding the turns up to it)
instead of mixing two branches. The request is translated into a `CallInput` (server/calls.py)
and runs the same pipeline as a chat completion; only the output shape and the stream's event
names (`response.created` ... `response.completed`) differ. Errors name Responses fields
(`input[1].content[0].text`, `max_output_tokens`).

Defaults OpenAI's client sends back (the ones a response body itself carries) are accepted:
`text.format` text, `tools: []`, `tool_choice` auto/none, `include: []`, `top_logprobs: 0`,
`background: false`, `max_tool_calls`, `reasoning` (this model does not reason: ignored).
The request's models and checks are in responses_models.py, the stream in responses_stream.py.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import orjson
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ultrafast.server.calls import CallInput, check_options, plain_params, prepare_call
from ultrafast.server.errors import APIError, invalid_value
from ultrafast.server.frontends.conversations import conversations_routes, new_conversation_id
from ultrafast.server.frontends.responses_models import ResponsesRequest, check_request
from ultrafast.server.frontends.responses_stream import final_status, stream_response
from ultrafast.server.generate import GenerationRun
from ultrafast.server.prompt import ChatMessage
from ultrafast.server.protocol_models import NAME_RE, validate_input
from ultrafast.server.sessions.flow import SessionFlow, not_found, tenant_name, turns_to_messages
from ultrafast.server.sessions.store import RESPONSE, SeqConflict, StoredObject, Turn
from ultrafast.server.state import ServerState, read_json
from ultrafast.server.tools.responses_api import call_item, plan_from_responses


def _usage(chat_usage: dict) -> dict:
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        # written: the prompt tokens prefilled now, whose KV the cache then holds
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": chat_usage["prompt_tokens"] - cached,
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


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
        self.message_index = 0  # the message item's output index (after calls, if later)

    def body(
        self,
        status: str,
        text: str = "",
        usage: dict | None = None,
        finish_reason: str | None = None,
        error: dict | None = None,
        calls: list[dict] | None = None,
    ) -> dict:
        output = []
        if status not in ("in_progress", "failed"):
            item_status = "completed" if status == "completed" else "incomplete"
            output = [call_item(c) for c in calls or ()]
            if text or not output:  # the message item, where the stream announced it
                output.insert(
                    min(self.message_index, len(output)), self.message_item(item_status, text)
                )
        conversation_id = self.req.conversation_id()
        req = self.req
        body = {
            "id": self.response_id,
            "object": "response",
            "created_at": int(self.created_s),
            "status": status,
            "model": self.model,
            "output": output,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if finish_reason == "length"
            else None,
            "instructions": req.instructions,
            "metadata": req.metadata or {},
            "previous_response_id": req.previous_response_id,
            "conversation": {"id": conversation_id} if conversation_id else None,
            "store": req.store,
            "background": False,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_logprobs": 0,
            "parallel_tool_calls": req.parallel_tool_calls is not False if req.tools else False,
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "text": {"format": req.text.format.echo()}
            if req.text and req.text.format
            else {"format": {"type": "text"}},
            "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None},
            "service_tier": self.tier,
            "usage": _usage(usage) if usage else None,
        }
        if req.user is not None:  # never "user": null
            body["user"] = req.user
        return body

    def message_item(self, status: str, text: str | None) -> dict:
        content = [] if text is None else [self.text_part(text)]
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, event_type: str, /, **fields) -> bytes:
        # positional-only: an event's own fields may include `name` (a function call's)
        payload = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def where(self) -> dict:
        return {"item_id": self.item_id, "output_index": self.message_index, "content_index": 0}

    def final(self, run: GenerationRun, commit_failed: str | None = None) -> dict:
        choice = run.choices[0]
        body = self.body(
            final_status(run),
            choice.text,
            run.usage(),
            choice.finish_reason,
            None,
            choice.tool_calls,
        )
        if commit_failed:
            body["error"] = {"code": commit_failed, "message": "the answer could not be stored"}
        return body


class History:
    """Where this call's turns come from and go to."""

    def __init__(self, session_id: str | None, turns: list[Turn], expect_seq: int | None):
        self.session_id = session_id
        self.turns = turns
        self.expect_seq = expect_seq  # the seq the new input must get (None: any)


async def resolve_history(flow: SessionFlow, tenant: str, req: ResponsesRequest) -> History:
    if req.previous_response_id is not None:
        prev = await flow.get_object(tenant, RESPONSE, req.previous_response_id)
        if prev is None or prev.session_id is None or prev.seq is None:
            raise not_found("previous_response", "previous_response_id")
        turns = await flow.turns(tenant, prev.session_id, prev.seq)
        return History(prev.session_id, turns, len(turns))
    conversation_id = req.conversation_id()
    if conversation_id is not None:
        if not NAME_RE.fullmatch(conversation_id):
            raise not_found("conversation", "conversation")
        turns = await flow.history(tenant, conversation_id, create=False, param="conversation")
        return History(conversation_id, turns, None)
    if not req.store:
        return History(None, [], None)
    session_id = "conv_" + uuid.uuid4().hex  # the chain's own session, never shown
    await flow.create(tenant, session_id)
    return History(session_id, [], 0)


def call_input(
    req: ResponsesRequest, state: ServerState, messages: list[ChatMessage], response_id: str
) -> CallInput:
    limits = state.limits_for(req.model)  # the named model's
    tools = plan_from_responses(req, limits)
    tier, auto = check_options(
        limits,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_output_tokens,
        max_tokens_param="max_output_tokens",
        service_tier=req.service_tier,
    )
    fmt = req.text.format if req.text else None
    params = plain_params(req.temperature, req.top_p, limits)
    if fmt is not None and fmt.type != "text":
        params = replace(params, grammar=fmt.grammar())
    return CallInput(
        chat=True,
        params=params,
        grammar_param="text.format.schema" if fmt and fmt.type == "json_schema" else "text.format",
        max_tokens=req.max_output_tokens,
        messages=messages,
        model=req.model,
        stream=req.stream,
        tier=tier,
        auto_tier=auto,
        tier_named=req.service_tier is not None,
        request_id=response_id,
        tools=tools,
        prompt_param="input",
        max_tokens_param="max_output_tokens",
    )


def response_id_for(tenant: str, idempotency_key: str | None) -> str:
    """A fresh id, or with an Idempotency-Key the same id for every retry of the call (the
    cluster's ingress adds one): its turns and its response object are then stored once."""
    if idempotency_key is None:
        return "resp_" + uuid.uuid4().hex
    if not NAME_RE.fullmatch(idempotency_key):
        raise invalid_value("Idempotency-Key", "Idempotency-Key must match [A-Za-z0-9_-]{1,64}")
    return "resp_" + uuid.uuid5(_RESPONSE_KEYS, f"{tenant}\n{idempotency_key}").hex


_RESPONSE_KEYS = uuid.UUID("6f1d8a52-3c0e-4f7e-9a55-2b8e0d4c7a11")  # namespace of keyed ids


async def store_input(
    flow: SessionFlow, tenant: str, history: History, new: list[ChatMessage], response_id: str
) -> str:
    """Persist the input; a reply to a response that is no longer the tip forks the session."""
    assert history.session_id is not None
    try:
        await flow.append_turns(tenant, history.session_id, new, response_id, history.expect_seq)
        return history.session_id
    except SeqConflict:
        fork_id = new_conversation_id()
        await flow.branch(tenant, history.session_id, history.turns, fork_id)
        await flow.append_turns(tenant, fork_id, new, response_id, len(history.turns))
        return fork_id


class ResponseCommit:
    """The run's commit: the assistant turn, then the response object beside its session and
    seq. Both store writes go through SessionFlow (its retries and error mapping)."""

    def __init__(self, flow: SessionFlow, tenant: str, session_id: str, builder: ResponseBuilder):
        self.flow, self.tenant, self.session_id, self.builder = flow, tenant, session_id, builder

    async def __call__(self, run: GenerationRun, reason: str | None) -> str | None:
        response_id = self.builder.response_id
        stored = await self.flow.commit_answer(
            run, reason, self.tenant, self.session_id, f"{response_id}-a", response_id
        )
        obj = StoredObject(
            self.builder.final(run),
            created_s=self.builder.created_s,
            session_id=self.session_id if stored is not None else None,
            seq=stored.seq if stored is not None else None,
        )
        try:
            await self.flow.put_object(self.tenant, RESPONSE, response_id, obj)
        except APIError:  # the store is down (503 mapped by SessionFlow)
            return "session_commit_failed"
        return None if stored is not None else "session_commit_failed"


def responses_routes(state: ServerState) -> list[Route]:
    flow = state.sessions
    assert flow is not None

    async def create(http: HTTPRequest) -> Response:
        req = validate_input(ResponsesRequest, await read_json(http, state))
        check_request(req, state)
        tenant = tenant_name(http)
        key = http.headers.get("idempotency-key")
        response_id = response_id_for(tenant, key)
        if key is not None and not req.stream and req.store:
            # a retry of a call that already ended and was stored gets that response back
            done = await flow.get_object(tenant, RESPONSE, response_id)
            if done is not None:
                return JSONResponse(done.body)
        new = req.new_messages()
        history = await resolve_history(flow, tenant, req)
        # a retry whose first attempt stored its input: those turns are this call's own, not
        # history (storing them again returns the stored ones: turn ids are idempotent)
        history.turns = [t for t in history.turns if not t.turn_id.startswith(response_id + "-")]
        system = [ChatMessage("system", req.instructions)] if req.instructions else []
        messages = system + turns_to_messages(history.turns, flow.model_name) + new
        run = await prepare_call(state, http.scope, call_input(req, state, messages, response_id))
        builder = ResponseBuilder(response_id, req, run.spec.model_name, run.spec.tier.api_name)
        try:
            if history.session_id is not None and req.store:
                session_id = await store_input(flow, tenant, history, new, response_id)
                run.set_commit(ResponseCommit(flow, tenant, session_id, builder))
        except BaseException:
            run.finish()
            raise
        if req.stream:
            return StreamingResponse(
                stream_response(run, builder),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-request-id": response_id},
            )
        return await _respond_json(http, run, builder)

    async def get(http: HTTPRequest) -> Response:
        obj = await flow.get_object(tenant_name(http), RESPONSE, http.path_params["response_id"])
        if obj is None:
            raise not_found("response", None)
        return JSONResponse(obj.body)

    async def delete(http: HTTPRequest) -> Response:
        response_id = http.path_params["response_id"]
        if not await flow.delete_object(tenant_name(http), RESPONSE, response_id):
            raise not_found("response", None)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", get, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
        *conversations_routes(state),
    ]


async def _respond_json(
    http: HTTPRequest, run: GenerationRun, builder: ResponseBuilder
) -> Response:
    if not await run.run_to_end(http):
        return Response(status_code=499)
    return JSONResponse(builder.final(run), headers=run.timing_headers())
