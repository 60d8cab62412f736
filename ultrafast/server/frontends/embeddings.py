"""Embeddings front end: OpenAI's `POST /v1/embeddings` and Ollama's `POST /api/embed`.

Both translate their wire format into one `EmbedCall` (inputs as token ids, tier, dimensions)
that runs through `run_embed_call`: the tenant's tier entitlement and rate limits (the same
auth functions chat uses), tokenizing on the worker pool, then the model's embedding engine
(engine/embed_engine.py through server/bridge.py), which batches the inputs of concurrent
requests into shared forward passes. Vectors are L2-normalised; `dimensions` keeps the first
d components and renormalises them. Errors come in each protocol's own shape: OpenAI's
envelope with the exact `param` path (`input[2][5]`) here, `{"error": "..."}` naming the
field for Ollama's route.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ultrafast.request import ServiceTier
from ultrafast.server import auth
from ultrafast.server.bridge import EmbeddingEngine, EmbedFailed, embed
from ultrafast.server.errors import (
    APIError,
    invalid_type,
    invalid_value,
    missing_field,
    quote,
    unknown_parameter,
)
from ultrafast.server.residency.budget import parse_keep_alive
from ultrafast.server.state import ServerState, check_ready, read_json

MAX_INPUTS = 2048  # OpenAI's limit per request
OPENAI_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "service_tier"}
OLLAMA_FIELDS = {"model", "input", "truncate", "dimensions", "keep_alive", "options"}
ERROR_STATUS = {"queue_full": 503, "input_too_long": 400, "engine_error": 500}


@dataclass
class EmbedCall:
    engine: EmbeddingEngine
    model: str
    texts: list[str] | None  # tokenized on the worker pool; or
    ids: list[list[int]] | None  # token ids as sent
    tier: ServiceTier = ServiceTier.DEFAULT
    auto_tier: bool = False
    tier_named: bool = True  # False: none named (OpenAI without service_tier, Ollama's)
    dimensions: int | None = None
    truncate: bool = False  # Ollama's: cut an input to the model's length (keeping [SEP])


@dataclass
class EmbedResult:
    vectors: np.ndarray  # (n, d) float32, L2-normalised
    prompt_tokens: int


# ---- the shared path -------------------------------------------------------------------------


def embedding_engine(state: ServerState, model: Any, param: str = "model") -> tuple[str, Any]:
    """(name, engine) of the embedding model a body names (the first one when it names none);
    400 for a chat model (no embedding mode), 404 for a name this server does not have."""
    if model is not None and not isinstance(model, str):
        raise invalid_type(param, "model must be a string")
    if not state.embedders:
        raise APIError(
            400,
            f"the model {quote(model or state.model_name)} has no embedding mode: this server "
            "serves no embedding model (start one with --models NAME=model.gguf)",
            code="model_not_embedding",
            param=param,
        )
    name = model if model is not None else next(iter(state.embedders))
    engine = state.embedders.get(name)
    if engine is not None:
        return name, engine
    served = ", ".join(state.embedders)
    if _is_chat_model(state, name):
        raise APIError(
            400,
            f"the model {quote(name)} is a chat model and has no embedding mode; "
            f"embedding models here: {served}",
            code="model_not_embedding",
            param=param,
        )
    raise APIError(
        404,
        f"the model {quote(name)} does not exist; embedding models here: {served}",
        "not_found_error",
        "model_not_found",
        param,
    )


def _is_chat_model(state: ServerState, name: str) -> bool:
    return name in state.models.runtimes and name not in state.embedders


async def run_embed_call(state: ServerState, scope: Any, call: EmbedCall) -> EmbedResult:
    check_ready(state)
    if not call.engine.alive:
        raise APIError(
            503,
            f"the embedding engine of {quote(call.model)} is not running",
            "server_error",
            "engine_dead",
            None,
            headers={"Retry-After": "5"},
        )
    tenant = auth.tenant_of(scope)
    asked, auto = call.tier, call.auto_tier
    if not call.tier_named:
        asked, auto = auth.unnamed_tier(scope, asked, auto)
    tier, _auto = auth.entitled_tier(tenant, asked, auto, "service_tier", state.auth_refused)
    auth.take_request(tenant, state.auth_refused)
    ids = call.ids
    if ids is None:
        assert call.texts is not None
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(state.pool, _tokenize_all, call.engine, call.texts)
    ids = _fit_lengths(call.engine, ids, call.truncate)
    num_tokens = sum(len(x) for x in ids)
    auth.take_tokens(tenant, num_tokens, state.auth_refused)
    try:
        rows = await embed(call.engine, ids, tier)
    except EmbedFailed as exc:
        code = exc.error.code
        status = ERROR_STATUS.get(code, 500)
        kind = "overloaded_error" if status == 503 else "server_error"
        if status == 400:
            kind = "invalid_request_error"
        headers = {"Retry-After": "1"} if status == 503 else None
        raise APIError(status, exc.error.message, kind, code, None, headers=headers) from None
    vectors = np.stack(rows)
    if call.dimensions is not None and call.dimensions < vectors.shape[1]:
        vectors = vectors[:, : call.dimensions]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return EmbedResult(vectors.astype(np.float32, copy=False), num_tokens)


def _tokenize_all(engine: EmbeddingEngine, texts: list[str]) -> list[list[int]]:
    return [engine.tokenize(text) for text in texts]


def _fit_lengths(engine: EmbeddingEngine, ids: list[list[int]], truncate: bool) -> list[list[int]]:
    limit = engine.max_input_tokens
    for i, one in enumerate(ids):
        if len(one) <= limit:
            continue
        if not truncate:
            raise APIError(
                400,
                f"input[{i}] has {len(one)} tokens; the model takes at most {limit}",
                code="context_length_exceeded",
                param=f"input[{i}]",
            )
        sep = engine.sep_token()
        ids[i] = one[: limit - 1] + [sep] if sep >= 0 and one[-1] == sep else one[:limit]
    return ids


# ---- OpenAI: POST /v1/embeddings ----------------------------------------------------------


def parse_openai(state: ServerState, body: dict) -> EmbedCall:
    unknown = sorted(set(body) - OPENAI_FIELDS)
    if unknown:
        raise unknown_parameter(unknown[0])
    name, engine = embedding_engine(state, body.get("model"))
    if "input" not in body:
        raise missing_field("input")
    texts, ids = parse_inputs(body["input"], engine.vocab_size)
    tier_name = body.get("service_tier")
    try:
        tier = ServiceTier.parse(tier_name if isinstance(tier_name, str | None) else "?")
    except ValueError:
        raise invalid_value(
            "service_tier", "service_tier must be one of auto, default, flex, priority"
        ) from None
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise invalid_value("encoding_format", "encoding_format must be float or base64")
    if not isinstance(body.get("user", ""), str):
        raise invalid_type("user", "user must be a string")
    return EmbedCall(
        engine,
        name,
        texts,
        ids,
        tier=tier,
        auto_tier=tier_name == "auto",
        tier_named=tier_name is not None,
        dimensions=parse_dimensions(body.get("dimensions"), engine.dimensions),
    )


def parse_inputs(value: Any, vocab_size: int) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's `input`: a string, strings, token ids, or lists of ids -> (texts, ids)."""
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise invalid_type("input", "input must be a string, a list of strings or token ids")
    if not value:
        raise invalid_value("input", "input must not be empty")
    if len(value) > MAX_INPUTS:
        raise invalid_value("input", f"input has {len(value)} items; at most {MAX_INPUTS}")
    if all(isinstance(item, str) for item in value):
        for i, text in enumerate(value):
            if not text:
                raise invalid_value(f"input[{i}]", f"input[{i}] is an empty string")
        return value, None
    if all(type(item) is int for item in value):
        return None, [_token_ids(value, vocab_size, "input")]
    if all(isinstance(item, list) for item in value):
        return None, [_token_ids(item, vocab_size, f"input[{i}]") for i, item in enumerate(value)]
    raise invalid_type(
        "input", "input must be all strings, all token ids, or all lists of token ids"
    )


def _token_ids(ids: list, vocab_size: int, param: str) -> list[int]:
    if not ids:
        raise invalid_value(param, f"{param} is an empty list of token ids")
    for j, token in enumerate(ids):
        if type(token) is not int:
            raise invalid_type(f"{param}[{j}]", f"{param}[{j}] must be an integer token id")
        if not 0 <= token < vocab_size:
            raise invalid_value(
                f"{param}[{j}]", f"{param}[{j}] = {token} is not a token id in [0, {vocab_size})"
            )
    return ids


def parse_dimensions(value: Any, model_dimensions: int) -> int | None:
    if value is None:
        return None
    if type(value) is not int:
        raise invalid_type("dimensions", "dimensions must be an integer")
    if not 1 <= value <= model_dimensions:
        raise invalid_value(
            "dimensions", f"dimensions must be in [1, {model_dimensions}] for this model"
        )
    return value


def openai_body(call: EmbedCall, result: EmbedResult, encoding: str) -> bytes:
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(row.astype("<f4").tobytes()).decode()
            if encoding == "base64"
            else row,
        }
        for i, row in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    body = {"object": "list", "data": data, "model": call.model, "usage": usage}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


# ---- Ollama: POST /api/embed --------------------------------------------------------------


def ollama_name(state: ServerState, model: Any) -> Any:
    """Ollama clients send `name:tag`: `name` and `name:latest` mean the served `name`
    (case-insensitive), as on Ollama's other routes (ollama_models.resolve_name)."""
    if not isinstance(model, str) or model in state.embedders:
        return model
    base = model.removesuffix(":latest").lower()
    return next((n for n in state.embedders if n.lower() == base), model)


def parse_ollama(state: ServerState, body: dict) -> EmbedCall:
    unknown = sorted(set(body) - OLLAMA_FIELDS)
    if unknown:
        raise unknown_parameter(unknown[0])
    if "model" not in body:
        raise missing_field("model")
    name, engine = embedding_engine(state, ollama_name(state, body["model"]))
    value = body.get("input", [])
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise invalid_type("input", "input must be a string or a list of strings")
    if not texts:
        raise invalid_value("input", "input must not be empty")
    if len(texts) > MAX_INPUTS:
        raise invalid_value("input", f"input has {len(texts)} items; at most {MAX_INPUTS}")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise invalid_type("truncate", "truncate must be true or false")
    if body.get("keep_alive") is not None:
        try:
            parse_keep_alive(body["keep_alive"])  # embedding models stay loaded: checked only
        except ValueError as exc:
            raise invalid_value("keep_alive", str(exc)) from None
    if not isinstance(body.get("options", {}), dict):
        raise invalid_type("options", "options must be an object")
    dimensions = parse_dimensions(body.get("dimensions"), engine.dimensions)
    return EmbedCall(
        engine, name, texts, None, tier_named=False, dimensions=dimensions, truncate=truncate
    )


def ollama_error(exc: APIError) -> JSONResponse:
    """Ollama's error shape: {"error": message}, the field named in the message."""
    message = exc.message
    if exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"
    return JSONResponse({"error": message}, status_code=exc.status, headers=exc.headers)


# ---- routes ----------------------------------------------------------------------------------


def embedding_routes(state: ServerState) -> list[Route]:
    async def openai_embeddings(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        call = parse_openai(state, body)
        result = await run_embed_call(state, http.scope, call)
        encoding = body.get("encoding_format", "float")
        return Response(openai_body(call, result, encoding), media_type="application/json")

    async def ollama_embed(http: HTTPRequest) -> Response:
        started = time.perf_counter_ns()
        try:
            call = parse_ollama(state, await read_json(http, state))
            result = await run_embed_call(state, http.scope, call)
        except APIError as exc:
            return ollama_error(exc)
        body = {
            "model": call.model,
            "embeddings": result.vectors,
            "total_duration": time.perf_counter_ns() - started,
            "load_duration": 0,  # embedding models load at start and stay resident
            "prompt_eval_count": result.prompt_tokens,
        }
        payload = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        return Response(payload, media_type="application/json")

    return [
        Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
        Route("/api/embed", ollama_embed, methods=["POST"]),
    ]
