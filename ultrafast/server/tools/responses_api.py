"""Function tools on the Responses API: the request's `tools` / `tool_choice`, the
`function_call` and `function_call_output` input items, and the output items and stream
events of the calls.

The agent fast path is the standard event order: `response.function_call_arguments.done`
and `response.output_item.done` for a call go out the moment its JSON closes, before the
response ends (and with one call allowed, the response ends there too).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Tag

from ultrafast.server.client_schema import check_client_schema
from ultrafast.server.errors import invalid_value, quote
from ultrafast.server.prompt import ChatMessage
from ultrafast.server.protocol import (
    Limits,
    _check_call_arguments,
    _require_feature,
)
from ultrafast.server.protocol_models import ITEM_TAGS, NAME_RE, StrictModel
from ultrafast.server.tools.parse import CallArgs, CallDone, CallStart
from ultrafast.server.tools.plan import FunctionTool, ToolPlan


class ResponsesFunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class ResponsesToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: str


class FunctionCallItem(StrictModel):
    """An earlier call of the model's, sent back as input (as the output carried it)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class OutputTextPart(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str


class FunctionCallOutputItem(StrictModel):
    """The client's result for a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[
        Annotated[str, Tag("string")] | Annotated[list[OutputTextPart], Tag("array")],
        Discriminator(lambda v: "string" if isinstance(v, str) else "array"),
    ]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output)


def item_type(value: Any) -> str:
    """Input items are told apart by `type` (a message may leave it out)."""
    kind = value.get("type", "message") if isinstance(value, dict) else "message"
    # a `type` that is not a string ({} or []) is the message model's 400, not a lookup
    return kind if isinstance(kind, str) and kind in ITEM_TAGS else "message"


def plan_from_responses(req: Any, limits: Limits) -> ToolPlan | None:
    """Validate `tools` / `tool_choice` (400s name `tools[i].name`, `tool_choice`)."""
    raw_tools = req.tools or []
    if not raw_tools:
        if req.tool_choice not in (None, "auto", "none"):
            raise invalid_value("tool_choice", "tool_choice needs tools")
        return None
    if len(raw_tools) > limits.max_tools:
        raise invalid_value("tools", f"at most {limits.max_tools} tools")
    tools, names = [], set()
    for i, raw in enumerate(raw_tools):
        if not isinstance(raw, dict) or raw.get("type") != "function":
            raise invalid_value(f"tools[{i}].type", "only function tools are available")
        try:
            tool = ResponsesFunctionTool.model_validate(raw)
        except ValueError as exc:
            raise invalid_value(f"tools[{i}]", f"not a function tool: {str(exc)[:200]}") from None
        if not NAME_RE.fullmatch(tool.name) or tool.name in names:
            raise invalid_value(
                f"tools[{i}].name", "tool names must be unique and match [A-Za-z0-9_-]{1,64}"
            )
        names.add(tool.name)
        if tool.parameters is not None:
            param = f"tools[{i}].parameters"
            check_client_schema(tool.parameters, param, limits, param)
            if tool.parameters.get("type", "object") != "object":
                raise invalid_value(param, "a tool's parameters must describe a JSON object")
        tools.append(
            FunctionTool(
                tool.name, tool.description, tool.parameters, tool.strict, f"[{i}].parameters"
            )
        )
    _require_feature("tools", limits)
    choice, named = _choice(req.tool_choice, names)
    most = getattr(req, "max_tool_calls", None)  # checked >= 0 by the request's own checks
    if most == 0 and choice in ("required", "function"):
        raise invalid_value(
            "max_tool_calls", f"max_tool_calls is 0, but tool_choice {choice!r} needs a call"
        )
    return ToolPlan(
        tools=tuple(tools),
        choice=choice,
        named=named,
        parallel=req.parallel_tool_calls is not False,
        asked_max_calls=most,
    )


def _choice(value: Any, names: set[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if value in ("auto", "none", "required"):
        return value, None
    try:
        named = ResponsesToolChoiceFunction.model_validate(value)
    except ValueError:
        raise invalid_value(
            "tool_choice", "tool_choice must be auto, none, required or {type: function, name}"
        ) from None
    if named.name not in names:
        raise invalid_value(
            "tool_choice", f"tool_choice names {quote(named.name)}, which is not in tools"
        )
    return "function", named.name


def function_items_to_messages(items: list[Any]) -> list[ChatMessage]:
    """Input items in order; consecutive calls join the assistant turn before them."""
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and not last.token_ids:
                calls = [*last.extra.get("tool_calls", []), call]
                out[-1] = ChatMessage(
                    "assistant", last.content, extra={**last.extra, "tool_calls": calls}
                )
            else:
                out.append(ChatMessage("assistant", "", extra={"tool_calls": [call]}))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage("tool", item.text(), extra={"tool_call_id": item.call_id}))
        else:
            out.append(ChatMessage(item.role, item.text()))
    return out


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    """A `function_call` output item from a chat-shaped call (`choice.tool_calls`)."""
    return {
        "type": "function_call",
        "id": item_id or "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def check_arguments_items(items: list[Any]) -> None:
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            _check_call_arguments(item.arguments, f"input[{i}].arguments")


class CallEvents:
    """Stream events of the calls, in the order the parser saw them; `index_of` gives each
    call its output index as it starts (after any message item already announced)."""

    def __init__(self, builder: Any) -> None:
        self.b = builder
        self.output_index: dict[int, int] = {}

    def events(self, tool_events: tuple, next_index: int) -> tuple[list[bytes], int]:
        out = []
        for e in tool_events:
            if isinstance(e, CallStart):
                self.output_index[e.index] = next_index
                next_index += 1
                item = call_item(
                    {"id": e.id, "function": {"name": e.name, "arguments": ""}}, "in_progress"
                )
                out.append(
                    self.b.event(
                        "response.output_item.added",
                        output_index=self.output_index[e.index],
                        item=item,
                    )
                )
            elif isinstance(e, CallArgs):
                out.append(
                    self.b.event(
                        "response.function_call_arguments.delta",
                        item_id="fc_" + e.id.removeprefix("call_"),
                        output_index=self.output_index[e.index],
                        delta=e.fragment,
                    )
                )
            elif isinstance(e, CallDone):
                call = {"id": e.id, "function": {"name": e.name, "arguments": e.arguments}}
                item = call_item(call, "completed" if e.complete else "incomplete")
                where = {"item_id": item["id"], "output_index": self.output_index[e.index]}
                out.append(
                    self.b.event(
                        "response.function_call_arguments.done",
                        name=e.name,
                        arguments=e.arguments,
                        **where,
                    )
                )
                out.append(
                    self.b.event(
                        "response.output_item.done", output_index=where["output_index"], item=item
                    )
                )
        return out, next_index
