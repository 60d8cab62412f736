"""Ollama's API: `/api/chat` and `/api/generate` over the one call pipeline, plus its model
routes (ollama_models.py).

A request becomes a `CallInput` (ollama_request.py): `/api/chat` a chat call, `/api/generate`
a chat call of `system` + `prompt` (or, with `raw`, the prompt as it is). `keep_alive` goes to
the residency cache as on every route. Streaming (the default) is NDJSON: one object per
output piece, `{"message": {"content": ...}, "done": false}` (`"response"` for generate), a
tool call as one object when its JSON closes, then the final object with `done_reason` and the
timings, each measured on this call, in nanoseconds:
  total_duration        from the request's arrival to the last byte's object
  load_duration         arrival to the engine's submit: the model lease (its load, if it was
                        not resident), template, tokenize and admission
  prompt_eval_duration  submit to the first output token (queue + prefill)
  eval_duration         first output token to the end
  prompt_eval_count     the prompt tokens evaluated: those the prefix cache did not hold (as
                        Ollama counts them); eval_count the generated ones.
An empty `messages` (or `prompt`) only loads the model (`done_reason` `load`, or `unload`
with `keep_alive` 0), as Ollama does.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ultrafast.server.calls import prepare_call
from ultrafast.server.errors import invalid_value
from ultrafast.server.frontends import ollama_errors
from ultrafast.server.frontends.common import key_tier
from ultrafast.server.frontends.ollama_models import model_routes, now_iso, resolve_name
from ultrafast.server.frontends.ollama_request import (
    ChatRequest,
    GenerateRequest,
    call_input,
    parse,
)
from ultrafast.server.generate import GenerationRun, Ping
from ultrafast.server.residency.budget import parse_keep_alive
from ultrafast.server.state import ServerState, check_generates, read_json
from ultrafast.server.tools.parse import CallDone


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


class Reply:
    """One call's Ollama objects: the pieces, and the final one with the measured timings."""

    def __init__(self, chat: bool, model: str, arrival_s: float):
        self.chat = chat
        self.model = model
        self.arrival_s = arrival_s
        self.submitted_s = arrival_s

    def piece(self, text: str, calls: list[dict] | None = None, **final) -> dict:
        out: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = text
        out["done"] = bool(final)
        return {**out, **final}

    def final(self, run: GenerationRun, text: str, calls: list[dict] | None = None) -> dict:
        end_s = time.monotonic()
        first_s = run.first_token_s or end_s
        choice = run.choices[0]
        extra: dict[str, Any] = {}
        if not self.chat:  # generate's `context`: the prompt and answer ids, for a reply
            extra["context"] = [*run.spec.prompts[0], *choice.token_ids]
        return self.piece(
            text,
            calls,
            done_reason="length" if choice.finish_reason == "length" else "stop",
            total_duration=_ns(end_s - self.arrival_s),
            load_duration=_ns(self.submitted_s - self.arrival_s),
            prompt_eval_count=len(run.spec.prompts[0]) - choice.num_cached_tokens,
            prompt_eval_duration=_ns(first_s - self.submitted_s),
            eval_count=run.num_output_tokens[0],
            eval_duration=_ns(end_s - first_s),
            **extra,
        )


def ollama_calls(done: tuple) -> list[dict]:
    """Tool calls as Ollama writes them: arguments as an object."""
    out = []
    for e in done:
        try:
            arguments = json.loads(e["function"]["arguments"])
        except ValueError:
            arguments = {}
        out.append({"function": {"name": e["function"]["name"], "arguments": arguments}})
    return out


async def _load_only(state: ServerState, req: Any, model: str, reply: Reply) -> Response:
    keep_alive = None
    if req.keep_alive is not None:
        try:
            keep_alive = parse_keep_alive(req.keep_alive)
        except ValueError as exc:
            raise invalid_value("keep_alive", str(exc)) from None
    _, release = await state.models.lease(  # loads it (with several models) and lets go
        model,
        keep_alive if req.keep_alive is not None else False,
        state.config.max_stream_buffer_events,
    )
    release()
    reason = "unload" if req.keep_alive is not None and keep_alive == 0 else "load"
    return JSONResponse(reply.piece("", done_reason=reason))


def ollama_routes(state: ServerState) -> list[Route]:
    async def handle(http: HTTPRequest, kind: type) -> Response:
        arrival_s = time.monotonic()
        body = await read_json(http, state)
        model = resolve_name(state, body.get("model") if isinstance(body, dict) else None)
        check_generates(state, model)  # an embedding model is listed, but does not chat
        limits = state.limits_for(model)
        req = parse(kind, body, limits)
        chat = kind is ChatRequest
        reply = Reply(chat, req.model, arrival_s)
        if (chat and not req.messages) or (not chat and not req.prompt):
            return await _load_only(state, req, model, reply)
        request_id = ("chat-" if chat else "gen-") + uuid.uuid4().hex[:24]
        call = call_input(req, model, limits, request_id, key_tier(http.scope))
        run = await prepare_call(state, http.scope, call)
        reply.submitted_s = time.monotonic()
        if req.stream:
            return StreamingResponse(
                _ndjson(run, reply),
                media_type="application/x-ndjson",
                headers={"x-request-id": request_id},
            )
        return await _respond_json(http, run, reply)

    async def chat(http: HTTPRequest) -> Response:
        return await handle(http, ChatRequest)

    async def generate(http: HTTPRequest) -> Response:
        return await handle(http, GenerateRequest)

    return [
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/generate", generate, methods=["POST"]),
        *model_routes(state),
    ]


async def _respond_json(http: HTTPRequest, run: GenerationRun, reply: Reply) -> Response:
    if not await run.run_to_end(http):
        return Response(status_code=499)
    choice = run.choices[0]
    body = reply.final(run, choice.text, ollama_calls(tuple(choice.tool_calls)))
    return JSONResponse(body, headers=run.timing_headers())


def _line(obj: dict) -> bytes:
    return orjson.dumps(obj) + b"\n"


async def _ndjson(run: GenerationRun, reply: Reply) -> AsyncIterator[bytes]:
    run.start()
    try:
        async for event in run.events():
            if isinstance(event, Ping):
                continue
            if event.finish == "error":
                break
            done = [
                {"function": {"name": e.name, "arguments": e.arguments}}
                for e in event.tool_events
                if isinstance(e, CallDone)
            ]
            if event.text or done:
                yield _line(reply.piece(event.text, ollama_calls(tuple(done)) if done else None))
        error = await run.conclude()
        if error is not None:
            yield _line({"error": ollama_errors.message_of(error)})
            return
        yield _line(reply.final(run, ""))
    finally:
        run.finish()
