"""`GET /v1/models` and `GET /v1/models/{model}`: the model(s) this server serves; with
several (server/residency/), each says whether it is loaded now (`status`, an extension).

A model id may hold slashes (`org/name`), so the retrieve route takes the rest of the path.
An unknown id is a 404 in OpenAI's error shape that names the id asked for.
"""

from __future__ import annotations

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ultrafast.server.errors import APIError, quote
from ultrafast.server.protocol_models import MAX_MODEL_NAME_CHARS


def model_object(state) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started_s),
        "owned_by": "ultrafast",
        "max_model_len": state.models.default.max_model_len,
    }


def model_not_found(name: str, served: str) -> APIError:
    # the type and code the chat and completions routes give for an unknown `model`
    return APIError(
        404,
        f"the model {quote(name, MAX_MODEL_NAME_CHARS)} does not exist; this server has {served!r}",
        "not_found_error",
        "model_not_found",
        "model",
    )


def resident_model_object(state, entry) -> dict:
    """One of several models: the OpenAI fields and whether it is loaded now (extension)."""
    return {
        "id": entry.name,
        "object": "model",
        "created": int(state.started_s),
        "owned_by": "ultrafast",
        **state.residency.describe(entry),
    }


def embedding_model_object(state, name: str) -> dict:
    """An embedding model (server/frontends/embeddings.py): its vector size and pooling."""
    engine = state.embedders[name]
    return {
        "id": name,
        "object": "model",
        "created": int(state.started_s),
        "owned_by": "ultrafast",
        "max_model_len": engine.max_input_tokens,
        "embedding": {"dimensions": engine.dimensions, "pooling": engine.pooling},
    }


def model_routes(state) -> list[Route]:
    async def list_models(http: HTTPRequest) -> Response:
        embedders = [embedding_model_object(state, name) for name in state.embedders]
        if state.residency is not None:
            entries = state.residency.entries.values()
            data = [resident_model_object(state, e) for e in entries]
            return JSONResponse({"object": "list", "data": data + embedders})
        chat = [] if state.model_name in state.embedders else [model_object(state)]
        return JSONResponse({"object": "list", "data": chat + embedders})

    async def retrieve_model(http: HTTPRequest) -> Response:
        name = http.path_params["model"]
        if name in state.embedders:
            return JSONResponse(embedding_model_object(state, name))
        if state.residency is not None:  # 404 naming the model unless it is one of ours
            return JSONResponse(resident_model_object(state, state.residency.entry(name)))
        if name != state.model_name:
            raise model_not_found(name, state.model_name)
        return JSONResponse(model_object(state))

    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    ]
