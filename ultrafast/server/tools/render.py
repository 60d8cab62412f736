"""Tools and tool history into the chat prompt.

A template with its own tool support (formats.detect_format) gets `tools=` as a template
variable (the HF convention) and the history as it is, with each call's arguments parsed to
an object as HF templates expect. A template without (SmolLM2's, the demo model's) gets a
system block that lists the tools and teaches the generic format, assistant calls written
back in that format, and tool results as user turns in `<tool_response>` tags, so the model
sees its own calls and their results as text it can follow.
"""

from __future__ import annotations

import json
from dataclasses import replace

from ultrafast.server.prompt import ChatMessage
from ultrafast.server.tools.formats import ToolFormat


def call_text(fmt: ToolFormat, name: str, arguments: str) -> str:
    """One call as the format spells it (compact JSON, as the grammar forces it)."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        args = arguments
    return '{"name":' + json.dumps(name, ensure_ascii=False) + f',"{fmt.args_key}":' + args + "}"


def calls_text(fmt: ToolFormat, calls: list[dict]) -> str:
    bodies = [call_text(fmt, c["function"]["name"], c["function"]["arguments"]) for c in calls]
    if fmt.array:
        return fmt.trigger + fmt.begin + fmt.separator.join(bodies) + fmt.end
    blocks = [
        (body if fmt.trigger_in_call else fmt.trigger + fmt.begin + body) + fmt.end
        for body in bodies
    ]
    return fmt.separator.join(blocks)


def system_block(fmt: ToolFormat, functions: list[dict]) -> str:
    listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    example = call_text(fmt, "<name>", '{"<parameter>":"<value>"}')
    return (
        "You may call these tools. To call one, reply with "
        f"{fmt.trigger}{example}{fmt.end} and nothing after it; "
        "the results come back in <tool_response> tags.\n"
        f"<tools>\n{listed}\n</tools>"
    )


def render_generic(
    fmt: ToolFormat, messages: list[ChatMessage], functions: list[dict] | None
) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for m in messages:
        calls = m.extra.get("tool_calls")
        extra = {k: v for k, v in m.extra.items() if k not in ("tool_calls", "tool_call_id")}
        if m.role == "tool":
            text = f"<tool_response>\n{m.content}\n</tool_response>"
            out.append(ChatMessage("user", text, extra=extra))
        elif m.role == "assistant" and calls:
            out.append(ChatMessage("assistant", m.content + calls_text(fmt, calls), extra=extra))
        else:
            out.append(m if m.extra == extra else replace(m, extra=extra))
    if functions:
        block = system_block(fmt, functions)
        if out and out[0].role in ("system", "developer"):
            first = out[0]
            out[0] = ChatMessage(first.role, block + "\n\n" + first.content, extra=first.extra)
        else:
            out.insert(0, ChatMessage("system", block))
    return out


def render_native(messages: list[ChatMessage]) -> list[ChatMessage]:
    """History for a template with tool support: arguments as objects (HF convention)."""
    out = []
    for m in messages:
        calls = m.extra.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        parsed = []
        for c in calls:
            try:
                args = json.loads(c["function"]["arguments"])
            except ValueError:
                args = c["function"]["arguments"]
            parsed.append({**c, "function": {**c["function"], "arguments": args}})
        out.append(replace(m, extra={**m.extra, "tool_calls": parsed}, token_ids=None))
    return out
