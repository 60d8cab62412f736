"""The Responses API's request: its wire models (`ResponsesRequest` and its parts) and the
checks pydantic cannot state, in the Responses API's own field names (`input`,
`max_output_tokens`, `text.format.schema`). responses.py turns a checked request into a call.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ultrafast.server.client_schema import check_client_schema
from ultrafast.server.errors import invalid_value, too_large, unsupported_parameter
from ultrafast.server.frontends.conversations import AnyInputItem, check_metadata
from ultrafast.server.prompt import ChatMessage
from ultrafast.server.protocol_models import (
    BY_JSON_TYPE,
    JSON_ARRAY,
    JSON_OBJECT,
    JSON_STRING,
    NAME_RE,
    StrictModel,
)
from ultrafast.server.state import ServerState
from ultrafast.server.structured import json_format_grammar
from ultrafast.server.tools.responses_api import check_arguments_items, function_items_to_messages


class ConversationRef(StrictModel):
    id: str


class TextFormat(StrictModel):
    """`text.format`: plain text, any JSON object, or a JSON schema (the Responses API puts
    name/schema/strict here directly, not under `json_schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: Any = Field(None, alias="schema")
    strict: bool | None = None

    def grammar(self):
        return json_format_grammar(self.type, self.schema_, self.strict, "text.format.schema")

    def echo(self) -> dict:
        """The format as a response body carries it."""
        out: dict[str, Any] = {"type": self.type}
        if self.type == "json_schema":
            out.update(name=self.name, schema=self.schema_, strict=bool(self.strict))
            if self.description is not None:  # omitted when unset, as OpenAI's bodies do
                out["description"] = self.description
        return out


class TextOptions(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # no obfuscation padding is ever added


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: Annotated[
        Annotated[str, JSON_STRING] | Annotated[list[AnyInputItem], JSON_ARRAY], BY_JSON_TYPE
    ]
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: (
        Annotated[
            Annotated[str, JSON_STRING] | Annotated[ConversationRef, JSON_OBJECT], BY_JSON_TYPE
        ]
        | None
    ) = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    service_tier: Any = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: bool | None = None
    # defaults a response carries, accepted when a client sends them back
    text: TextOptions | None = None
    tools: list[Any] | None = None  # function tools, checked by tools/responses_api.py
    tool_choice: Any = None
    include: list[str] | None = None  # only []
    top_logprobs: int | None = None  # only 0
    background: bool | None = None  # only false
    max_tool_calls: int | None = None
    reasoning: Reasoning | None = None
    safety_identifier: str | None = None  # hints: accepted, not needed here
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: StreamOptions | None = None

    def conversation_id(self) -> str | None:
        c = self.conversation
        return c.id if isinstance(c, ConversationRef) else c

    def new_messages(self) -> list[ChatMessage]:
        if isinstance(self.input, str):
            return [ChatMessage("user", self.input)]
        return function_items_to_messages(self.input)


def check_request(req: ResponsesRequest, state: ServerState) -> None:
    """What pydantic cannot say, in the Responses API's own field names."""
    limits = state.limits_for(req.model)
    if isinstance(req.input, list) and not req.input:
        raise invalid_value("input", "input must not be empty")
    num_chars = len(req.instructions or "") + sum(len(m.content) for m in req.new_messages())
    if num_chars > limits.max_prompt_chars:
        raise too_large(
            "prompt_too_large", "input", f"the input exceeds {limits.max_prompt_chars} characters"
        )
    if isinstance(req.input, list):
        check_arguments_items(req.input)
    if req.include:
        raise unsupported_parameter("include", "include is not available on this server")
    if req.top_logprobs:
        raise unsupported_parameter(
            "top_logprobs", "top_logprobs is not available with the Responses API on this server"
        )
    if req.background:
        raise unsupported_parameter("background", "background responses are not available")
    if req.max_tool_calls is not None and req.max_tool_calls < 0:
        raise invalid_value("max_tool_calls", "max_tool_calls must be >= 0")
    if req.previous_response_id is not None and req.conversation is not None:
        raise invalid_value("conversation", "send previous_response_id or conversation, not both")
    check_metadata(req.metadata)
    _check_text_format(req, state)


def _check_text_format(req: ResponsesRequest, state: ServerState) -> None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return
    if fmt.type == "json_schema":
        if not isinstance(fmt.schema_, dict):
            raise invalid_value("text.format.schema", "type json_schema needs a schema object")
        if fmt.name is None or not NAME_RE.fullmatch(fmt.name):
            raise invalid_value("text.format.name", "name must match [A-Za-z0-9_-]{1,64}")
        param = "text.format.schema"
        check_client_schema(fmt.schema_, param, state.limits_for(req.model), param)
    if "response_format" not in state.limits_for(req.model).features:
        raise unsupported_parameter("text.format", "structured output is not available here")
