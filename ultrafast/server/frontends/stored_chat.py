"""Chat completions stored with `store: true`: `GET /v1/chat/completions` (list, with `after`,
`limit`, `order`, `model` and `metadata[key]=value` filters), `GET`/`DELETE
/v1/chat/completions/{id}` and `GET /v1/chat/completions/{id}/messages`, per tenant, as OpenAI's
API has them. The completion is written to the session store (SQLite or Redis) at the end of
its run, before the response (or the stream's last event) goes out, so a GET right after the
call finds it. A store outage does not fail the call that asked to be stored: the completion is
still answered, and only the stored copy is missing (logged).
"""

from __future__ import annotations

import logging
import re
import time

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ultrafast.server import openai_format as fmt
from ultrafast.server.errors import APIError, invalid_value
from ultrafast.server.generate import GenerationRun
from ultrafast.server.protocol import ChatCompletionRequest
from ultrafast.server.sessions.flow import SessionFlow, not_found, tenant_name
from ultrafast.server.sessions.store import CHAT_COMPLETION, StoredObject
from ultrafast.server.state import ServerState

log = logging.getLogger(__name__)

_METADATA_QUERY = re.compile(r"metadata\[(.{1,64})\]")


def store_chat_completion(
    flow: SessionFlow, http: HTTPRequest, req: ChatCompletionRequest, run: GenerationRun
) -> None:
    """Make the run's commit the stored copy of the completion (n choices, as answered)."""
    tenant = tenant_name(http)
    messages = req.messages_for_template()  # content parts joined, as the model saw them
    metadata = dict(req.metadata or {})
    created_s = time.time()  # list order: the call's arrival, finer than `created` seconds

    async def commit(run: GenerationRun, reason: str | None) -> str | None:
        spec = run.spec
        body = fmt.chat_response(
            spec.request_id,
            spec.model_name,
            spec.tier.api_name,
            run.choices,
            run.usage(),
            run.deps.tokenizer.decode,
            spec.want_logprobs,
        )
        body["metadata"] = metadata
        try:
            await flow.put_object(
                tenant,
                CHAT_COMPLETION,
                spec.request_id,
                StoredObject(body, created_s=created_s, metadata=metadata, messages=messages),
            )
        except APIError:
            log.warning(
                "stored chat completion %s not written: the store is unavailable", spec.request_id
            )
        return None  # the answer itself stands either way

    run.set_commit(commit)


def stored_chat_routes(state: ServerState) -> list[Route]:
    flow = state.sessions
    assert flow is not None

    async def find(http: HTTPRequest) -> StoredObject:
        obj = await flow.get_object(
            tenant_name(http), CHAT_COMPLETION, http.path_params["completion_id"]
        )
        if obj is None:
            raise not_found("chat_completion", None)
        return obj

    async def list_completions(http: HTTPRequest) -> Response:
        wanted = {}
        for key, value in http.query_params.multi_items():
            match = _METADATA_QUERY.fullmatch(key)
            if match:
                wanted[match.group(1)] = value
            elif key not in ("after", "limit", "order", "model"):
                raise invalid_value(key[:64], f"unknown query parameter {key[:64]!r}")
        model = http.query_params.get("model")
        stored = await flow.list_objects(tenant_name(http), CHAT_COMPLETION)
        items = [
            o.body
            for o in stored
            if all(o.metadata.get(k) == v for k, v in wanted.items())
            and (model is None or o.body.get("model") == model)
        ]
        return JSONResponse(fmt.list_page(http.query_params, items, "asc"))

    async def get(http: HTTPRequest) -> Response:
        return JSONResponse((await find(http)).body)

    async def messages(http: HTTPRequest) -> Response:
        obj = await find(http)
        completion_id = obj.body["id"]
        items = [
            {"id": f"{completion_id}-{i}", "content": None, **m} for i, m in enumerate(obj.messages)
        ]
        return JSONResponse(fmt.list_page(http.query_params, items, "asc"))

    async def delete(http: HTTPRequest) -> Response:
        completion_id = http.path_params["completion_id"]
        if not await flow.delete_object(tenant_name(http), CHAT_COMPLETION, completion_id):
            raise not_found("chat_completion", None)
        return JSONResponse(
            {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}
        )

    return [
        Route("/v1/chat/completions", list_completions, methods=["GET"]),
        Route("/v1/chat/completions/{completion_id}", get, methods=["GET"]),
        Route("/v1/chat/completions/{completion_id}", delete, methods=["DELETE"]),
        Route("/v1/chat/completions/{completion_id}/messages", messages, methods=["GET"]),
    ]
