"""Anthropic Messages requests: their shape, and their translation into a `CallInput`.

`system` (a string or text blocks) leads the chat; `messages` alternate user and assistant
turns of text, `tool_use` (assistant) and `tool_result` (user) blocks. A `tool_use` becomes
the assistant's tool call and a `tool_result` the tool turn answering it (in the order the
user turn lists them, before its text), so the model's chat template renders the loop as it
renders OpenAI's. Images and documents are refused by name: this server serves text models.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import Field

from ultrafast.request import ServiceTier
from ultrafast.server.calls import CallInput, check_options, plain_params
from ultrafast.server.client_schema import check_client_schema
from ultrafast.server.errors import invalid_value, too_large, unsupported_content
from ultrafast.server.frontends.common import ToolSpec, tool_plan, validated
from ultrafast.server.prompt import ChatMessage
from ultrafast.server.protocol import Limits, _require_feature
from ultrafast.server.protocol_models import BY_JSON_TYPE, JSON_ARRAY, JSON_STRING, StrictModel
from ultrafast.server.structured import json_format_grammar
from ultrafast.server.tools.plan import ToolPlan

MEDIA_BLOCKS = frozenset({"image", "document", "search_result", "container_upload"})
REASONING_BLOCKS = frozenset({"thinking", "redacted_thinking"})
MAX_STOP_SEQUENCES = 16
# Anthropic's own tier names, and this server's (priority is reachable by name)
TIERS = {
    "auto": (ServiceTier.DEFAULT, True),
    "standard_only": (ServiceTier.DEFAULT, False),
    "default": (ServiceTier.DEFAULT, False),
    "priority": (ServiceTier.PRIORITY, False),
    "flex": (ServiceTier.FLEX, False),
}


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: Any = None  # the prefix cache is automatic: accepted, not needed
    citations: Any = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: (
        Annotated[
            Annotated[str, JSON_STRING] | Annotated[list[TextBlock], JSON_ARRAY], BY_JSON_TYPE
        ]
        | None
    ) = None
    is_error: bool | None = None
    cache_control: Any = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


class ToolDef(StrictModel):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: Any = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(StrictModel):
    user_id: str | None = None


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    """Structured output (`format`) through the grammar path; `effort` is a reasoning hint
    this model has no use for (accepted)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    content: Annotated[Annotated[str, JSON_STRING] | Annotated[list[Any], JSON_ARRAY], BY_JSON_TYPE]


class MessagesRequest(StrictModel):
    model: str
    messages: list[MessageParam]
    max_tokens: int
    system: (
        Annotated[
            Annotated[str, JSON_STRING] | Annotated[list[TextBlock], JSON_ARRAY], BY_JSON_TYPE
        ]
        | None
    ) = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    stream: bool | None = None
    service_tier: str | None = None
    thinking: Any = None  # only {"type": "disabled"}
    output_config: OutputConfig | None = None
    speed: Literal["standard", "fast"] | None = None  # fast: the priority tier
    # hints of Anthropic's platform, accepted and not needed here (the prefix cache is
    # automatic, there is one place and one workspace)
    cache_control: Any = None
    inference_geo: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class CountTokensRequest(StrictModel):
    """`/v1/messages/count_tokens`: the prompt fields of a Messages request."""

    model: str
    messages: list[MessageParam]
    system: (
        Annotated[
            Annotated[str, JSON_STRING] | Annotated[list[TextBlock], JSON_ARRAY], BY_JSON_TYPE
        ]
        | None
    ) = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Any = None


def parse_request(body: Any, limits: Limits, counting: bool = False):
    """The validated request (400 naming the field); blocks are checked by `to_messages`."""
    if isinstance(body, dict):  # JSON null means "not sent", as the SDK may send it
        body = {k: v for k, v in body.items() if v is not None}
    req = validated(CountTokensRequest if counting else MessagesRequest, body)
    if not req.messages:
        raise invalid_value("messages", "messages must hold at least one message")
    if len(req.messages) > limits.max_messages:
        raise invalid_value("messages", f"at most {limits.max_messages} messages")
    thinking = req.thinking
    if thinking is not None and not (
        isinstance(thinking, dict) and thinking == {"type": "disabled"}
    ):
        raise invalid_value("thinking", "extended thinking is not available for this model")
    return req


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None:
        return None
    return system if isinstance(system, str) else "".join(b.text for b in system)


def _block(raw: Any, at: str):
    kind = raw.get("type") if isinstance(raw, dict) else None
    kind = kind if isinstance(kind, str) else None  # {"type": {...}} is no block type
    if kind == "text":
        return validated(TextBlock, raw, at)
    if kind == "tool_use":
        return validated(ToolUseBlock, raw, at)
    if kind == "tool_result":
        return validated(ToolResultBlock, raw, at)
    if kind in MEDIA_BLOCKS:
        raise unsupported_content(
            f"{at}.type", f"{kind} blocks are not supported: this server serves text models"
        )
    if kind in REASONING_BLOCKS:
        raise unsupported_content(f"{at}.type", f"{kind} blocks need extended thinking")
    if not isinstance(raw, dict):
        raise invalid_value(at, "a content block must be a JSON object")
    raise invalid_value(
        f"{at}.type", "a content block's type must be one of text, tool_use, tool_result"
    )


def to_messages(req: Any, limits: Limits) -> list[ChatMessage]:
    """The chat, in the pipeline's terms; 400 naming `messages[i].content[j]...` on bad blocks."""
    out: list[ChatMessage] = []
    system = system_text(req.system)
    if system:
        out.append(ChatMessage("system", system))
    tool_use_ids: set[str] = set()
    num_chars = len(system or "")
    for i, message in enumerate(req.messages):
        content = message.content
        if isinstance(content, str):
            out.append(ChatMessage(message.role, content))
            num_chars += len(content)
            continue
        blocks = [_block(raw, f"messages[{i}].content[{j}]") for j, raw in enumerate(content)]
        turn = _turn(message.role, blocks, f"messages[{i}].content", tool_use_ids)
        out += turn
        num_chars += sum(len(m.content) for m in turn)
    if num_chars > limits.max_prompt_chars:
        raise too_large(
            "prompt_too_large",
            "messages",
            f"the prompt exceeds {limits.max_prompt_chars} characters",
        )
    return out


def _turn(role: str, blocks: list, at: str, tool_use_ids: set[str]) -> list[ChatMessage]:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if role == "assistant":
        calls = []
        for j, b in enumerate(blocks):
            if isinstance(b, ToolResultBlock):
                raise invalid_value(f"{at}[{j}].type", "tool_result blocks belong in user turns")
            if isinstance(b, ToolUseBlock):
                tool_use_ids.add(b.id)
                arguments = json.dumps(b.input, ensure_ascii=False, separators=(",", ":"))
                calls.append(
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name, "arguments": arguments},
                    }
                )
        extra = {"tool_calls": calls} if calls else {}
        return [ChatMessage("assistant", text, extra=extra)]
    out = []
    for j, b in enumerate(blocks):
        if isinstance(b, ToolUseBlock):
            raise invalid_value(f"{at}[{j}].type", "tool_use blocks belong in assistant turns")
        if isinstance(b, ToolResultBlock):
            if b.tool_use_id not in tool_use_ids:
                raise invalid_value(
                    f"{at}[{j}].tool_use_id",
                    "no earlier assistant tool_use block has this id",
                )
            result = ("Error: " if b.is_error else "") + b.text()
            out.append(ChatMessage("tool", result, extra={"tool_call_id": b.tool_use_id}))
    if text or not out:
        out.append(ChatMessage("user", text))
    return out


def plan_of(req: Any, limits: Limits) -> ToolPlan | None:
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice.type not in ("auto", "none"):
            raise invalid_value("tool_choice", "tool_choice needs tools")
        return None
    specs = [ToolSpec(t.name, t.description, t.input_schema) for t in req.tools]
    kind = "auto" if choice is None else choice.type
    if kind == "tool" and not choice.name:
        raise invalid_value("tool_choice.name", "tool_choice of type tool needs a name")
    return tool_plan(
        specs,
        "tools",
        limits,
        choice={"auto": "auto", "any": "required", "tool": "function", "none": "none"}[kind],
        named=choice.name if kind == "tool" else None,
        parallel=not (choice is not None and choice.disable_parallel_tool_use),
        schema_field="input_schema",
    )


def _check_ranges(
    req: MessagesRequest, limits: Limits, default_tier: ServiceTier
) -> tuple[ServiceTier, bool]:
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise invalid_value("temperature", "temperature must be in [0.0, 1.0]")
    if req.top_k is not None and req.top_k < 0:
        raise invalid_value("top_k", "top_k must be >= 0")
    stops = req.stop_sequences or []
    if len(stops) > MAX_STOP_SEQUENCES or any(
        not s or len(s.encode()) > limits.max_stop_bytes for s in stops
    ):
        raise invalid_value(
            "stop_sequences",
            f"at most {MAX_STOP_SEQUENCES} stop sequences, each 1 to {limits.max_stop_bytes} bytes",
        )
    check_options(
        limits,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_tokens,
        max_tokens_param="max_tokens",
    )
    if req.speed == "fast":  # Anthropic's fast mode is this server's priority tier
        if req.service_tier not in (None, "auto", "priority"):
            raise invalid_value("speed", "speed fast is the priority tier, not standard_only")
        return ServiceTier.PRIORITY, False
    if req.service_tier is None:
        return default_tier, False
    if req.service_tier not in TIERS:
        raise invalid_value(
            "service_tier",
            "service_tier must be auto or standard_only (or priority, default, flex)",
        )
    return TIERS[req.service_tier]


def call_input(
    req: MessagesRequest,
    limits: Limits,
    request_id: str,
    default_tier: ServiceTier = ServiceTier.DEFAULT,
) -> CallInput:
    """`default_tier`: the tier when the request names none (the key's, common.key_tier)."""
    tier, auto = _check_ranges(req, limits, default_tier)
    messages = to_messages(req, limits)
    if req.messages[-1].role == "assistant":  # a prefill would be answered as a whole turn
        raise invalid_value(
            f"messages[{len(req.messages) - 1}].role",
            "the last message must be a user turn: continuing an assistant turn (prefill) "
            "is not available on this server",
        )
    params = plain_params(req.temperature, req.top_p, limits)
    if req.top_k is not None:
        params = replace(params, top_k=req.top_k if req.top_k < limits.vocab_size else 0)
    fmt = req.output_config.format if req.output_config else None
    if fmt is not None:
        param = "output_config.format.schema"
        check_client_schema(fmt.schema_, param, limits, param)
        _require_feature("response_format", limits)
        params = replace(params, grammar=json_format_grammar("json_schema", fmt.schema_, True))
    return CallInput(
        chat=True,
        params=params,
        max_tokens=req.max_tokens,
        messages=messages,
        model=req.model,
        stream=bool(req.stream),
        stops=list(req.stop_sequences or []),
        tier=tier,
        auto_tier=auto,
        # `auto` names no tier of ours: the key's default_tier serves it where it has one
        tier_named=req.service_tier != "auto" or req.speed == "fast",
        request_id=request_id,
        tools=plan_of(req, limits),
        tier_param="service_tier",
        prompt_param="messages",
        max_tokens_param="max_tokens",
        grammar_param="output_config.format" if fmt is not None else "tools",
    )
