"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

The request becomes a `CallInput` (anthropic_request.py) and runs the one call pipeline
(server/calls.py): the same tenants (a key in `x-api-key` or `Authorization: Bearer`, see
server/auth.py), tiers (`service_tier` `auto` takes priority when the key may have it,
`standard_only` the default tier; `priority` by name is an extension; none: the key's
default, common.key_tier), admission, prefix
cache, grammar-constrained tool calls, output guard and metrics. Only the shapes differ:
the message object, its stop_reason (`end_turn`, `max_tokens`, `stop_sequence` with the
sequence, `tool_use`, `refusal` for the guard, `model_context_window_exceeded`), its usage
(`input_tokens` are the prompt tokens not read from the prefix cache, as Anthropic counts
them; `cache_read_input_tokens` the ones that were), the stream's events
(anthropic_stream.py), and the error shape (anthropic_errors.py). `anthropic-version` is
accepted whatever its value.
"""

from __future__ import annotations

import json
import uuid

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ultrafast.request import ServiceTier
from ultrafast.server.calls import prepare_call
from ultrafast.server.errors import APIError
from ultrafast.server.frontends import anthropic_errors
from ultrafast.server.frontends.anthropic_request import (
    call_input,
    parse_request,
    plan_of,
    to_messages,
)
from ultrafast.server.frontends.anthropic_stream import stream_message
from ultrafast.server.frontends.common import count_prompt_tokens, key_tier
from ultrafast.server.generate import ENGINE_FAILED, ChoiceDelta, GenerationRun, run_error
from ultrafast.server.guard import CONTENT_FILTER
from ultrafast.server.state import ServerState, read_json


class MessageBuilder:
    """The message object's fields for one call, and its final values from the run."""

    def __init__(self, message_id: str, model: str):
        self.message_id = message_id
        self.model = model

    @staticmethod
    def tool_use_id(call_id: str) -> str:
        return "toolu_" + call_id.removeprefix("call_")

    def start_message(self, run: GenerationRun) -> dict:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**self.usage(run), "output_tokens": 0},
        }

    def usage(self, run: GenerationRun) -> dict:
        chat = run.usage()
        cached = chat["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": chat["prompt_tokens"] - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": chat["completion_tokens"],
            "service_tier": "priority" if run.spec.tier == ServiceTier.PRIORITY else "standard",
        }

    @staticmethod
    def stop_reason(run: GenerationRun) -> tuple[str, str | None]:
        finish = run.choices[0].finish_reason
        if finish == "tool_calls":
            return "tool_use", None
        if finish == "length":
            if run.num_output_tokens[0] >= run.spec.params.max_tokens:
                return "max_tokens", None
            return "model_context_window_exceeded", None
        if finish == CONTENT_FILTER:
            return "refusal", None
        matched = run.matchers[0].matched
        if finish == "stop" and matched is not None:
            return "stop_sequence", matched
        return "end_turn", None

    def content(self, run: GenerationRun) -> list[dict]:
        choice = run.choices[0]
        blocks: list[dict] = []
        if choice.text or not choice.tool_calls:
            blocks.append({"type": "text", "text": choice.text})
        for call in choice.tool_calls:
            try:
                arguments = json.loads(call["function"]["arguments"])
            except ValueError:  # a call cut by max_tokens
                arguments = {}
            blocks.append(
                {
                    "type": "tool_use",
                    "id": self.tool_use_id(call["id"]),
                    "name": call["function"]["name"],
                    "input": arguments if isinstance(arguments, dict) else {},
                }
            )
        return blocks

    def final(self, run: GenerationRun) -> dict:
        reason, sequence = self.stop_reason(run)
        return {
            **self.start_message(run),
            "content": self.content(run),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage(run),
        }

    @staticmethod
    def error_body(error: APIError) -> dict:
        return anthropic_errors.body(error)


def anthropic_routes(state: ServerState) -> list[Route]:
    async def create(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        limits = state.limits_for(body.get("model"))
        req = parse_request(body, limits)
        message_id = "msg_" + uuid.uuid4().hex[:24]
        call = call_input(req, limits, message_id, key_tier(http.scope))
        run = await prepare_call(state, http.scope, call)
        builder = MessageBuilder(message_id, req.model)
        if req.stream:
            return await _respond_stream(run, builder)
        return await _respond_json(http, run, builder)

    async def count_tokens(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        limits = state.limits_for(body.get("model"))
        req = parse_request(body, limits, counting=True)
        messages, plan = to_messages(req, limits), plan_of(req, limits)
        # the named model's own tokenizer (404 for another name), loaded or not
        tokenizer = state.models.get(req.model).tokenizer
        num = await count_prompt_tokens(tokenizer, state.pool, messages, plan, "messages")
        return JSONResponse({"input_tokens": num})

    return [
        Route("/v1/messages", create, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]


async def _respond_json(http: HTTPRequest, run: GenerationRun, builder: MessageBuilder) -> Response:
    if not await run.run_to_end(http):
        return Response(status_code=499)
    headers = {**run.timing_headers(), "request-id": builder.message_id}
    return JSONResponse(builder.final(run), headers=headers)


async def _respond_stream(run: GenerationRun, builder: MessageBuilder) -> Response:
    """Headers wait for the first output (its cached-prefix count goes in message_start), so
    a failure before it is a plain HTTP error in Anthropic's shape."""
    run.start()
    events = run.events().__aiter__()
    first = []
    try:
        first.append(await events.__anext__())
    except StopAsyncIteration:
        pass
    except BaseException:
        run.finish()
        raise
    head = first[0] if first else None
    if isinstance(head, ChoiceDelta) and head.finish == "error":
        run.finish()
        raise run_error(ENGINE_FAILED)
    return StreamingResponse(
        stream_message(run, first, events, builder),
        media_type="text/event-stream",
        headers={
            **run.timing_headers(),
            "cache-control": "no-cache",
            "request-id": builder.message_id,
        },
    )
