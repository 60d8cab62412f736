"""HTTP routes of the OpenAI-compatible server, and the OpenAI error envelope for every failure.

Order of work per call: size/content-type/JSON checks, strict field validation, model check,
capacity (503 before any tokenizing), template + tokenize off the event loop, context check,
SLO admission (429 for a priority call that would miss its target), then generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ultrafast.config import ServerConfig
from ultrafast.request import ServiceTier
from ultrafast.runtime.engine import EngineThread
from ultrafast.server.admission import Admission
from ultrafast.server import auth
from ultrafast.server.guard import GuardConfig
from ultrafast.server.metrics import ServerMetrics
from ultrafast.server.models_api import model_routes
from ultrafast.server.tenants import ApiKeys
from ultrafast.server.bridge import EngineBridge
from ultrafast.server.chat_tokens import encode_chat
from ultrafast.server.errors import APIError
from ultrafast.server.generate import GenerationRun, GenerationSpec
from ultrafast.server.idempotent_replay import replay_response
from ultrafast.server.json_body import check_content_type, parse_json_body
from ultrafast.server.playground import playground_routes
from ultrafast.server.protocol import Limits, parse_chat_request, parse_completion_request
from ultrafast.server.session_flow import ChatSession, SessionFlow, tenant_of
from ultrafast.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    config: ServerConfig
    engine: EngineThread
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    limits: Limits
    admission: Admission
    bridge: EngineBridge | None = None  # made on startup, when the event loop exists
    draining: bool = False
    started_s: float = field(default_factory=time.time)
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="ultrafast-tokenize"))
    runs: set = field(default_factory=set)  # GenerationRuns in flight, for the drain
    sessions: SessionFlow | None = None  # server-side conversations (server/session_flow.py)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    api_keys: ApiKeys | None = None  # None: no auth, loopback only
    guard: GuardConfig | None = None  # None: output goes out unfiltered
    auth_refused: dict = field(default_factory=dict)  # reason -> count, for metrics

    def abort_everything(self) -> None:
        """Drain timeout: every unfinished choice ends with finish_reason "abort"."""
        for run in list(self.runs):
            run.generation.abort_from_server()


def error_response(error: APIError, request_id: str) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status,
                        headers={**error.headers, "x-request-id": request_id})


async def read_json(http: HTTPRequest, state: ServerState) -> dict:
    check_content_type(http.headers.get("content-type"))
    limit = state.config.max_body_bytes
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes", "invalid_request_error",
                       "payload_too_large", None)
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:  # chunked bodies are counted as they arrive, never buffered past
                raise APIError(413, f"request body is larger than {limit} bytes",
                               "invalid_request_error", "payload_too_large", None)
            chunks.append(chunk)
    except ClientDisconnect:  # the client left, or the body timed out (408 already sent)
        raise APIError(408, "the request body did not arrive in full", "invalid_request_error",
                       "request_timeout", None) from None
    return parse_json_body(b"".join(chunks), max_bytes=limit)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server has "
                       f"{state.model_name!r}", "not_found_error", "model_not_found", "model")


def _check_ready(state: ServerState) -> None:
    if not state.engine.alive:  # first: a dead engine also starts the shutdown (exit 2)
        raise APIError(503, "the engine is not running", "server_error", "engine_dead", None,
                       headers={"Retry-After": "5"})
    if state.draining:
        raise APIError(503, "the server is shutting down", "overloaded_error",
                       "server_shutting_down", None, headers={"Retry-After": "5"})


def _resolve_max_tokens(state: ServerState, requested: int | None, num_prompt: int,
                        param: str) -> int:
    room = state.max_model_len - num_prompt
    if room <= 0:
        raise APIError(400, f"the prompt has {num_prompt} tokens but this model's context is "
                       f"{state.max_model_len} tokens", "invalid_request_error",
                       "context_length_exceeded", param)
    if requested is None:
        return min(room, state.config.max_tokens_cap)
    if requested > room:
        raise APIError(400, f"max_tokens={requested} plus the prompt's {num_prompt} tokens "
                       f"exceeds this model's context of {state.max_model_len} tokens",
                       "invalid_request_error", "context_length_exceeded", "max_tokens")
    return requested


async def _generate(http: HTTPRequest, state: ServerState, req, chat: bool) -> Response:
    session = None
    if chat and req.session_id is not None:  # history from the store, joined with the new turn
        _check_model(state, req.model)
        _check_ready(state)
        session = await ChatSession.open(state.sessions, http, req)
        if session.replay is not None:
            return replay_response(state, req, session.replay)
    try:
        run = await prepare_run(http, state, req, chat, session.messages if session else None)
    except BaseException:
        if session is not None:
            session.release()
        raise
    if session is not None:
        try:
            await session.start(run)  # from here the session commit frees the key
        except BaseException:
            session.release()
            run.finish()
            raise
    if run.spec.stream:
        return await run.respond_stream()
    return await run.respond_json(http)


async def prepare_run(http: HTTPRequest, state: ServerState, req, chat: bool,
                      messages: list[dict] | None = None,
                      request_id: str | None = None) -> GenerationRun:
    """Validate, tokenize and admit one call; the run is not started. `messages` replaces the
    chat request's own (a session's history joined with the new turn)."""
    arrival_s = time.monotonic()
    request_id = request_id or ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    _check_model(state, req.model)
    _check_ready(state)
    tenant = auth.tenant_of(http.scope)
    tier_param = "service_tier" if req.service_tier is not None else "priority"
    tier, auto = auth.entitled_tier(tenant, req.tier(), req.tier_is_auto(),
                                    tier_param, state.auth_refused)
    auth.take_request(tenant, state.auth_refused)
    ticket = state.admission.reserve(tier, auto=auto, tenant=tenant.name)
    prediction_ids: list[int] | None = None
    try:
        loop = asyncio.get_running_loop()
        if chat:
            messages = messages if messages is not None else req.messages_for_template()
            prompts = [await loop.run_in_executor(state.pool, encode_chat, state.tokenizer,
                                                  messages)]
            echo = None
            if req.prediction_text():  # predicted outputs: the engine drafts from these ids
                prediction_ids = await loop.run_in_executor(
                    state.pool, state.tokenizer.encode, req.prediction_text(), False)
        else:
            prompts = await loop.run_in_executor(state.pool, _completion_prompts, state, req)
            echo = [state.tokenizer.decode(p) for p in prompts] if req.echo else None
        longest = max(len(p) for p in prompts)
        param = "messages" if chat else "prompt"
        if not all(prompts):
            raise APIError(400, "the prompt is empty", "invalid_request_error", "invalid_value",
                           param)
        max_tokens = _resolve_max_tokens(state, req.requested_max_tokens(), longest, param)
        params = req.sampling_params(state.tokenizer.vocab_size, max_tokens)
        num_tokens_taken = auth.take_tokens(
            tenant, (sum(len(p) for p in prompts) + max_tokens * len(prompts)) * req.n,
            state.auth_refused)
        try:
            # admission predicts TTFT from the tokens left to prefill, not the cached history
            num_new = await loop.run_in_executor(state.pool, _num_uncached, state, prompts,
                                                 tenant.name)
            state.admission.admit(ticket, num_new * req.n, auto)
        except APIError:
            _refund_tokens(tenant, num_tokens_taken, 0)
            raise
        spec = GenerationSpec(
            request_id=request_id, model_name=state.model_name, prompts=prompts, params=params,
            n=req.n, tier=ticket.tier, stops=req.stop_list(), chat=chat, stream=bool(req.stream),
            include_usage=req.include_usage(), want_logprobs=params.logprobs, echo_texts=echo,
            arrival_s=arrival_s, prediction_token_ids=prediction_ids, tenant=tenant.name)
        run = GenerationRun(state, spec, ticket)
        if num_tokens_taken:
            run.on_finish.append(lambda r: _refund_tokens(
                tenant, num_tokens_taken, sum(len(p) for p in prompts) * req.n
                + sum(r.num_output_tokens)))
        return run
    except BaseException:
        state.admission.release(ticket)
        raise


def _num_uncached(state: ServerState, prompts: list[list[int]], tenant: str) -> int:
    pool = state.engine.core.pool
    return sum(len(p) - pool.num_cached_prefix_tokens(p, tenant) for p in prompts)


def _refund_tokens(tenant, num_taken: int, num_used: int) -> None:
    """Give back the reserved tokens a call did not use (max_tokens is an upper bound)."""
    if tenant.token_bucket is not None and num_taken > num_used:
        tenant.token_bucket.give_back(num_taken - num_used)


def _completion_prompts(state: ServerState, req) -> list[list[int]]:
    prompts = []
    for prompt in req.prompt_list():
        prompts.append(prompt if isinstance(prompt, list) else state.tokenizer.encode(prompt))
    return prompts


def build_app(state: ServerState) -> Starlette:
    async def chat_completions(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        return await _generate(http, state, parse_chat_request(body, state.limits), chat=True)

    async def completions(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        return await _generate(http, state, parse_completion_request(body, state.limits),
                               chat=False)

    async def health(http: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(http: HTTPRequest) -> Response:
        if state.draining or not state.engine.alive:
            reason = "engine_dead" if not state.engine.alive else "draining"
            return JSONResponse({"status": reason}, status_code=503)
        core = state.engine.core
        return JSONResponse({"status": "ready", "running": len(core.scheduler.running),
                             "waiting": core.scheduler.num_waiting,
                             "kv_slots_busy": core.pool.num_running,
                             "kv_slots_total": core.pool.num_slots,
                             "in_flight": {t.api_name: n for t, n in
                                           state.admission.in_flight.items()},
                             "session_store": None if state.sessions is None else
                             "ok" if state.sessions.store_ok else "degraded"})

    async def metrics(http: HTTPRequest) -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    async def tokenize(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        text = _tokenize_input(state, body)
        ids = await asyncio.get_running_loop().run_in_executor(
            state.pool, state.tokenizer.encode, text, bool(body.get("add_special_tokens", True)))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len})

    async def detokenize(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        tokens = body.get("tokens")
        vocab = state.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(
                type(t) is int and 0 <= t < vocab for t in tokens):
            raise APIError(400, f"tokens must be a list of ids in [0, {vocab})",
                           "invalid_request_error", "invalid_value", "tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(tokens)})

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        *model_routes(state),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        *playground_routes(),
        *conversation_routes(state),
    ]

    async def on_api_error(http: HTTPRequest, exc: APIError) -> Response:
        return error_response(exc, http.headers.get("x-request-id") or uuid.uuid4().hex)

    async def on_http_error(http: HTTPRequest, exc: HTTPException) -> Response:
        rid = uuid.uuid4().hex
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "POST")
            error = APIError(405, f"{http.method} is not allowed here", "invalid_request_error",
                             "method_not_allowed", None, headers={"Allow": allow})
        elif exc.status_code == 404:
            error = APIError(404, f"no route {http.url.path}", "not_found_error",
                             "route_not_found", None)
        else:
            error = APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, None)
        return error_response(error, rid)

    async def on_crash(http: HTTPRequest, exc: Exception) -> Response:
        log.exception("unhandled error")  # details stay in the log, never in the body
        return error_response(APIError(500, "internal server error", "server_error",
                                       "internal_error", None), uuid.uuid4().hex)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.bridge = EngineBridge(state.engine, asyncio.get_running_loop(),
                                    state.config.max_stream_buffer_events)
        yield
        if state.sessions is not None:
            await state.sessions.store.close()

    state.metrics.add_refusal_source(lambda: state.admission.refused)
    state.metrics.add_refusal_source(lambda: state.auth_refused)
    state.metrics.set_in_flight_source(
        lambda: {t.api_name: n for t, n in state.admission.in_flight.items()})
    hosts = auth.allowed_hosts_for(state.config.host, state.config.allowed_hosts)
    middleware = [Middleware(auth.HostAllowListMiddleware, allowed_hosts=hosts),
                  Middleware(auth.AuthMiddleware, keys=state.api_keys,
                             refused=state.auth_refused)]
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware, exception_handlers={
        APIError: on_api_error, HTTPException: on_http_error, Exception: on_crash})


def conversation_routes(state: ServerState) -> list:
    from ultrafast.server.realtime import realtime_routes
    from ultrafast.server.responses_api import responses_routes

    return [*responses_routes(state), *realtime_routes(state)] if state.sessions else []


def _tokenize_input(state: ServerState, body: dict) -> str:
    if isinstance(body.get("prompt"), str):
        return body["prompt"]
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        req = parse_chat_request({"messages": messages}, state.limits)
        return state.tokenizer.apply_chat_template(req.messages_for_template())
    raise APIError(400, "send `prompt` (a string) or `messages`", "invalid_request_error",
                   "missing_required_field", "prompt")


__all__ = ["ServerState", "build_app", "ServiceTier"]
