"""OpenAI's Conversations API over the session store: `/v1/conversations` and its items.

A conversation is a session: chat completions reach the same history with `session_id`, the
Responses API with `conversation`. Items are the stored turns in OpenAI's message-item shape
(user text as `input_text`, assistant text as `output_text`). Input items (here and in the
Responses API's `input`) are validated strictly: text content only, known fields only, and
a refusal names the exact item path (`input[2].content[0].text`).
`POST /v1/conversations/{id}` replaces the conversation's metadata.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import Discriminator, Tag
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ultrafast.server.errors import invalid_value
from ultrafast.server.openai_format import list_object, list_page
from ultrafast.server.prompt import ChatMessage
from ultrafast.server.protocol_models import (
    BY_JSON_TYPE,
    JSON_ARRAY,
    JSON_STRING,
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    NAME_RE,
    StrictModel,
    validate_input,
)
from ultrafast.server.sessions.flow import SessionFlow, not_found, tenant_name
from ultrafast.server.sessions.store import Turn
from ultrafast.server.state import ServerState, read_json
from ultrafast.server.tools.responses_api import (
    FunctionCallItem,
    FunctionCallOutputItem,
    call_item,
    function_items_to_messages,
    item_type,
)


class TextPart(StrictModel):
    type: Literal["input_text", "output_text", "text"]
    text: str
    # a response's own output_text parts, sent back as input, carry these: ignored
    annotations: list | None = None
    logprobs: list | None = None


class InputItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[
        Annotated[str, JSON_STRING] | Annotated[list[TextPart], JSON_ARRAY], BY_JSON_TYPE
    ]
    id: str | None = None  # echoed items from a previous output
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


# an item as input: a message, or (function tools) an earlier call and its result
AnyInputItem = Annotated[
    Annotated[InputItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(item_type),
]


class CreateConversation(StrictModel):
    items: list[AnyInputItem] | None = None
    metadata: dict[str, str] | None = None


class UpdateConversation(StrictModel):
    metadata: dict[str, str]  # required, as in OpenAI's API: the whole new metadata


class AddItems(StrictModel):
    items: list[AnyInputItem]


def check_metadata(metadata: dict | None) -> dict:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS or any(
        len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()
    ):
        raise invalid_value(
            "metadata",
            f"metadata holds at most {MAX_METADATA_PAIRS} pairs, "
            f"keys <= {MAX_METADATA_KEY} and values <= {MAX_METADATA_VALUE} chars",
        )
    return metadata


def items_to_messages(items: list[InputItem]) -> list[ChatMessage]:
    return [ChatMessage(item.role, item.text()) for item in items]


def turn_to_items(turn: Turn) -> list[dict]:
    """A turn as items: a tool turn is a `function_call_output`, an assistant turn that
    called tools is its message (when it has text) and one `function_call` per call."""
    if turn.tool_call_id is not None:
        return [
            {
                "type": "function_call_output",
                "id": f"fco_{turn.turn_id}",
                "call_id": turn.tool_call_id,
                "output": turn.content,
                "status": turn.status,
            }
        ]
    calls = [call_item(c, turn.status) for c in turn.tool_calls or ()]
    return ([turn_to_item(turn)] if turn.content or not calls else []) + calls


def turn_to_item(turn: Turn) -> dict:
    part = "output_text" if turn.role == "assistant" else "input_text"
    content: dict = {"type": part, "text": turn.content}
    if part == "output_text":
        content["annotations"] = []
        content["logprobs"] = []  # a list, as in OpenAI's items; none are stored
    return {
        "type": "message",
        "id": f"msg_{turn.turn_id}",
        "status": turn.status,
        "role": turn.role,
        "content": [content],
    }


def new_conversation_id() -> str:
    return "conv_" + uuid.uuid4().hex


def conversation_object(session_id: str, created_s: float, metadata: dict) -> dict:
    return {
        "id": session_id,
        "object": "conversation",
        "created_at": int(created_s),
        "metadata": metadata,
    }


def _path_id(http: HTTPRequest) -> str:
    conversation_id = http.path_params["conversation_id"]
    if not NAME_RE.fullmatch(conversation_id):
        raise not_found("conversation", None)
    return conversation_id


def conversations_routes(state: ServerState) -> list[Route]:
    flow = state.sessions
    assert flow is not None
    return [*_conversation_routes(state, flow), *_item_routes(state, flow)]


def _conversation_routes(state: ServerState, flow: SessionFlow) -> list[Route]:
    """Create, read, update and delete a conversation."""

    async def create(http: HTTPRequest) -> Response:
        req = validate_input(CreateConversation, await read_json(http, state))
        tenant, conversation_id = tenant_name(http), new_conversation_id()
        info = await flow.create(tenant, conversation_id, check_metadata(req.metadata))
        if req.items:
            await flow.append_turns(
                tenant,
                conversation_id,
                function_items_to_messages(req.items),
                f"{conversation_id}-init",
            )
        return JSONResponse(conversation_object(conversation_id, info.created_s, info.metadata))

    async def get(http: HTTPRequest) -> Response:
        conversation_id = _path_id(http)
        info = await flow.get(tenant_name(http), conversation_id)
        if info is None:
            raise not_found("conversation", None)
        return JSONResponse(conversation_object(conversation_id, info.created_s, info.metadata))

    async def delete(http: HTTPRequest) -> Response:
        conversation_id = _path_id(http)
        if not await flow.delete(tenant_name(http), conversation_id):
            raise not_found("conversation", None)
        return JSONResponse(
            {"id": conversation_id, "object": "conversation.deleted", "deleted": True}
        )

    async def update(http: HTTPRequest) -> Response:
        conversation_id = _path_id(http)
        req = validate_input(UpdateConversation, await read_json(http, state))
        info = await flow.set_metadata(
            tenant_name(http), conversation_id, check_metadata(req.metadata)
        )
        if info is None:
            raise not_found("conversation", None)
        return JSONResponse(conversation_object(conversation_id, info.created_s, info.metadata))

    return [
        Route("/v1/conversations", create, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", get, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}", update, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", delete, methods=["DELETE"]),
    ]


def _item_routes(state: ServerState, flow: SessionFlow) -> list[Route]:
    """A conversation's items: listed a page at a time, or appended."""

    async def list_items(http: HTTPRequest) -> Response:
        conversation_id, tenant = _path_id(http), tenant_name(http)
        if await flow.get(tenant, conversation_id) is None:
            raise not_found("conversation", None)
        items = [i for t in await flow.turns(tenant, conversation_id) for i in turn_to_items(t)]
        return JSONResponse(list_page(http.query_params, items, "desc"))

    async def add_items(http: HTTPRequest) -> Response:
        conversation_id, tenant = _path_id(http), tenant_name(http)
        req = validate_input(AddItems, await read_json(http, state))
        if await flow.get(tenant, conversation_id) is None:
            raise not_found("conversation", None)
        key = http.headers.get("idempotency-key") or uuid.uuid4().hex
        turns = await flow.append_turns(
            tenant, conversation_id, function_items_to_messages(req.items), f"items-{key}"[:80]
        )
        return JSONResponse(list_object([i for t in turns for i in turn_to_items(t)], False))

    return [
        Route("/v1/conversations/{conversation_id}/items", list_items, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items", add_items, methods=["POST"]),
    ]


__all__ = ["conversations_routes", "InputItem", "items_to_messages"]
