"""HTTP routes of the OpenAI-compatible server, and the OpenAI error envelope for every failure.

Each API's routes come from its front end in frontends/ (chat completions and completions in
frontends/chat.py, the Responses, Conversations, Realtime, stored chat, Anthropic and Ollama
APIs beside it), each only translating its wire format into a `CallInput`; the call itself
runs through server/calls.py (checks, tokenize, admission) and server/generate.py (the run).
Here: the app's assembly, the service routes (health, ready, metrics, tokenize) and the
error handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ultrafast.server import auth
from ultrafast.server.access_log import AccessLogMiddleware
from ultrafast.server.calls import chat_messages, template_error
from ultrafast.server.errors import APIError, invalid_type
from ultrafast.server.frontends import error_response_for, frontend_routes
from ultrafast.server.frontends.chat import chat_routes
from ultrafast.server.frontends.embeddings import embedding_routes
from ultrafast.server.frontends.realtime import realtime_routes
from ultrafast.server.frontends.responses import responses_routes
from ultrafast.server.frontends.stored_chat import stored_chat_routes
from ultrafast.server.models_api import model_routes
from ultrafast.server.playground import playground_routes
from ultrafast.server.prompt import encode_chat
from ultrafast.server.protocol import parse_chat_request
from ultrafast.server.runtime import ModelRuntime
from ultrafast.server.state import ServerState, read_json
from ultrafast.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)


def build_app(state: ServerState) -> Starlette:
    routes = [
        *chat_routes(state),
        *model_routes(state),
        *embedding_routes(state),
        *_service_routes(state),
        *frontend_routes(state),  # Anthropic's and Ollama's APIs (before the playground's /)
        *playground_routes(),
        *conversation_routes(state),
    ]
    state.metrics.add_refusal_source(state.models.refused)
    state.metrics.add_refusal_source(lambda: state.auth_refused)
    state.metrics.set_in_flight_source(state.in_flight_by_tier)
    hosts = auth.allowed_hosts_for(state.config.host, state.config.allowed_hosts)
    middleware = [
        Middleware(auth.HostAllowListMiddleware, allowed_hosts=hosts),
        Middleware(
            auth.AuthMiddleware,
            keys=state.api_keys,
            refused=state.auth_refused,
            render=error_response_for,
        ),
    ]
    if state.config.access_log:  # outermost: refusals before routing are logged too
        middleware.insert(0, Middleware(AccessLogMiddleware))
    return Starlette(
        routes=routes,
        lifespan=_lifespan(state),
        middleware=middleware,
        exception_handlers=_exception_handlers(),
    )


def _service_routes(state: ServerState) -> list[Route]:
    """Health, readiness, metrics, and the tokenizer's own routes."""

    async def health(http: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(http: HTTPRequest) -> Response:
        models = state.models
        if state.draining or not models.alive:
            reason = "engine_dead" if not models.alive else "draining"
            return JSONResponse({"status": reason}, status_code=503)
        snap = models.snapshot()
        return JSONResponse(
            {
                "status": "ready",
                "running": snap.num_running,
                "waiting": snap.num_waiting,
                "kv_slots_busy": snap.num_kv_slots_running,
                "kv_slots_total": snap.num_kv_slots_total,
                "in_flight": state.in_flight_by_tier(),
                # TTFT targets in force (measured from the model's idle speed, or configured)
                "tier_targets": models.default.admission.describe_targets(),
                "idle_speed": _idle_speed(snap.idle_speed),
                # thread plan and idle speed: cached, or being measured in the background
                "start_costs": snap.start_costs,
                # the wide prefill path: by need, loading, untimed, on or off (and why)
                "wide_pass": snap.wide_pass,
                # the file llama.cpp runs: the model's, or its bf16 file's float16 copy
                "llama_weights": snap.llama_weights,
                "session_store": None
                if state.sessions is None
                else "ok"
                if state.sessions.store_ok
                else "degraded",
            }
        )

    async def metrics(http: HTTPRequest) -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    async def tokenize(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        runtime = _named_model(state, body)
        ids = await asyncio.get_running_loop().run_in_executor(
            state.pool, _tokenize_ids, runtime, body
        )
        return JSONResponse(
            {"tokens": ids, "count": len(ids), "max_model_len": runtime.max_model_len}
        )

    async def detokenize(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        tokens = body.get("tokens")
        tokenizer = _named_model(state, body).tokenizer
        vocab = tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(
            type(t) is int and 0 <= t < vocab for t in tokens
        ):
            raise APIError(
                400,
                f"tokens must be a list of ids in [0, {vocab})",
                "invalid_request_error",
                "invalid_value",
                "tokens",
            )
        return JSONResponse({"prompt": tokenizer.decode(tokens)})

    return [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]


def _exception_handlers() -> dict[Any, Callable[..., Awaitable[Response]]]:
    """Every failure in the OpenAI envelope, or in the shape of the protocol its path is."""

    async def on_api_error(http: HTTPRequest, exc: APIError) -> Response:
        rid = http.headers.get("x-request-id") or uuid.uuid4().hex
        return error_response_for(http.url.path, exc, rid)

    async def on_http_error(http: HTTPRequest, exc: HTTPException) -> Response:
        rid = uuid.uuid4().hex
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "POST")
            error = APIError(
                405,
                f"{http.method} is not allowed here",
                "invalid_request_error",
                "method_not_allowed",
                None,
                headers={"Allow": allow},
            )
        elif exc.status_code == 404:
            error = APIError(
                404, f"no route {http.url.path}", "not_found_error", "route_not_found", None
            )
        else:
            error = APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, None)
        return error_response_for(http.url.path, error, rid)

    async def on_crash(http: HTTPRequest, exc: Exception) -> Response:
        log.exception("unhandled error")  # details stay in the log, never in the body
        return error_response_for(
            http.url.path,
            APIError(500, "internal server error", "server_error", "internal_error", None),
            uuid.uuid4().hex,
        )

    # Starlette calls each handler with an instance of the class it is registered for
    return {APIError: on_api_error, HTTPException: on_http_error, Exception: on_crash}


def _lifespan(state: ServerState):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        # the default model's bridge now, on the serving loop (others: at their first lease)
        state.models.default.bridge_on_loop(state.config.max_stream_buffer_events)
        if state.residency is not None:
            state.residency.start()  # keep_alive expiry and preloading
        yield
        if state.sessions is not None:
            await state.sessions.store.close()

    return lifespan


def conversation_routes(state: ServerState) -> list:
    if state.sessions is None:
        return []
    return [*responses_routes(state), *realtime_routes(state), *stored_chat_routes(state)]


def _named_model(state: ServerState, body: dict) -> ModelRuntime:
    """/tokenize and /detokenize: the runtime of the body's `model` (none: the default one);
    its tokenizer is there whether the model is loaded or not."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid_type("model", "model must be a string")
    return state.models.get(model)


def _tokenize_ids(runtime: ModelRuntime, body: dict) -> list[int]:
    """A raw `prompt` as /v1/completions tokenizes it (special-token text parsed); `messages`
    as a chat call does (encode_chat: client text never becomes control ids)."""
    tokenizer = runtime.tokenizer
    if isinstance(body.get("prompt"), str):
        return tokenizer.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        req = parse_chat_request({"messages": messages}, runtime.limits)
        try:
            return encode_chat(tokenizer, chat_messages(req))
        except ChatTemplateError as exc:
            raise template_error(exc, "messages") from None
    raise APIError(
        400,
        "send `prompt` (a string) or `messages`",
        "invalid_request_error",
        "missing_required_field",
        "prompt",
    )


def _idle_speed(speed) -> dict | None:
    """EngineSnapshot.idle_speed for /ready: a typical prompt timed on the idle engine at start."""
    if speed is None:
        return None
    return {
        "prompt_tokens": speed.prompt_tokens,
        "ttft_ms": round(speed.ttft_s * 1000, 2),
        "decode_ms": None if speed.decode_s is None else round(speed.decode_s * 1000, 3),
    }


__all__ = ["ServerState", "build_app"]
