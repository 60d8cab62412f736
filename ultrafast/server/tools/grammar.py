"""The Lark grammar (llguidance syntax) that keeps a tool-calling reply inside its format.

`tool_choice` decides the shape: `auto` lets free text run until the format's trigger and
constrains only what follows (a lazy lexeme: the trigger is matched in free text, then each
call is forced to `{"name":"<one of the tools>","arguments":<its parameters' schema>}`);
`required` and a named function force a call from the first token. With one call allowed
(`parallel_tool_calls: false`, or a named function) the grammar ends at that call's close, so
the only next token is end-of-sequence: generation stops right after the closing brace (the
format's closing text, `</tool_call>` or `]`, is left out: the parser needs no more).

Where the format's text holds a special token of the model's vocabulary (Mistral's
`[TOOL_CALLS]` is one control token), the grammar names that token by id (`<[id]>`):
llguidance keeps special tokens out of quoted text and free text, so spelled as text the model
could never emit its native trigger. Free text then may not spell the trigger out either, so
the parser only ever sees the trigger the token wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ultrafast.config import MAX_TOOL_CALLS
from ultrafast.grammar.json_lark import JsonLark
from ultrafast.grammar.schema_check import SchemaProblem
from ultrafast.server.tools.formats import ToolFormat

DEFAULT_MAX_CALLS = MAX_TOOL_CALLS  # parallel calls one turn may make (serve --max-tool-calls)


@dataclass(frozen=True)
class ToolSchema:
    name: str
    parameters: dict | None  # None or {}: no arguments (`{}`)
    param: str = ""  # where the schema is under the request's `tools` ("[1].parameters")


def _lit(text: str, tokens: Mapping[str, int] | None = None) -> str:
    """`text` as grammar items: quoted, except each special token inside it (`tokens`: text
    -> id), which becomes `<[id]>` (the model writes it as that one token)."""
    if not text:
        return ""
    if not tokens:
        return json.dumps(text)
    pattern = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
    items, pos = [], 0
    for found in re.finditer(pattern, text):
        if found.start() > pos:
            items.append(json.dumps(text[pos : found.start()]))
        items.append(f"<[{tokens[found.group()]}]>")
        pos = found.end()
    if pos < len(text):
        items.append(json.dumps(text[pos:]))
    return " ".join(items)


def _closed(schema: Any) -> Any:
    """Objects that list their properties take no others unless the schema says so: a
    function takes the parameters it names (OpenAI's strict mode requires the same), and a
    small model otherwise invents keys until max_tokens. Every output still validates."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _closed(v) for k, v in out["properties"].items()}
        if not _OPEN_KEYS & out.keys():
            out["additionalProperties"] = False
    for key in ("$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v) for k, v in out[key].items()}
    return out


_SUBSCHEMAS = frozenset({"items", "anyOf", "oneOf", "prefixItems"})
# an object that says anything about other keys, or combines schemas, stays as it is
_OPEN_KEYS = frozenset(
    {"additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref"}
)


# a function declared without parameters (or with `{}`) takes none: its arguments are `{}`
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _schema(parameters: dict | None, lark: JsonLark) -> str:
    """The arguments' expression (its rules go into `lark.rules`)."""
    schema: dict[str, Any] = _closed(parameters) if parameters else dict(NO_ARGUMENTS)
    schema.setdefault("type", "object")
    # properties keep their order: the grammar makes the model write them in it
    return lark.schema(schema)


def tool_call_lark(
    fmt: ToolFormat,
    tools: list[ToolSchema],
    *,
    required: bool,
    single: bool,
    tokens: Mapping[str, int] | None = None,
    answer: tuple[str, list[str]] | None = None,
    max_calls: int = DEFAULT_MAX_CALLS,
) -> str:
    """`required`: a call from the first token (else free text first, calls after the
    trigger); `single`: exactly one call, then end-of-sequence. `tokens`: the special tokens
    (text -> id) the format's texts contain (ToolFormat.special_tokens). `answer`: the rule
    body (and its rules) an answer that is not a call must follow (a `response_format`):
    then the reply is either that answer or calls, never free text. `max_calls`: the most
    calls one turn may make (a repetitive model otherwise repeats one call until max_tokens)."""
    tokens = tokens or {}
    lines = ["%llguidance {}"]
    names = []
    for i, tool in enumerate(tools):
        head = '{"name":' + json.dumps(tool.name) + "," + json.dumps(fmt.args_key) + ":"
        if fmt.trigger_in_call:  # the trigger `{"name":` is already written
            head = head[len(fmt.trigger) :]
        args = JsonLark(prefix=f"t{i}_")
        try:
            expr = _schema(tool.parameters, args)
        except SchemaProblem as problem:  # no arguments can match: the caller's 400
            where = f" at {problem.path}" if problem.path else ""
            path = problem.param(tool.param) if tool.param else ""  # under `tools`
            message = f"tool {tool.name!r}{where}: {problem}"
            raise SchemaProblem(path, message, problem.code) from None
        lines.append(f"call_{i}: {_lit(head)} {expr} " + '"}"')
        lines += args.rules
        names.append(f"call_{i}")
    lines.append("call: " + " | ".join(names))
    open_rest = fmt.begin  # after the trigger
    trigger, separator = _lit(fmt.trigger, tokens), _lit(fmt.separator, tokens)
    end = "" if single else _lit(fmt.end, tokens)
    extra = 0 if single else max(max_calls, 1) - 1  # calls after the first
    if fmt.array:
        lines += _bounded("more_calls", f"{separator} call", extra)
        calls = "call more_calls_0" if extra else "call"
        lines.append(f"block_rest: {_lit(open_rest, tokens)} {calls} {end}")
        more = ""
    else:
        lines.append(f"block_rest: {_lit(open_rest, tokens)} call {end}")
        lines += _bounded("more_calls", f"{separator} {trigger} block_rest", extra)
        more = " more_calls_0" if extra else ""
    if required:
        lines.append(f"start: {trigger} block_rest{more}")
    elif answer is not None:  # the schema's answer or calls: no free text
        lines.append(f"answer: {answer[0]}")
        lines += answer[1]
        lines.append(f"start: answer | {trigger} block_rest{more}")
    elif trigger == _lit(fmt.trigger):  # a text trigger: a lazy lexeme ends at its first match
        lines.append("TEXT: /(.|\\n)*/")
        lines.append(f"trigger[lazy]: TEXT {trigger}")
        lines.append(f"start: TEXT | trigger block_rest{more}")
    else:  # a special token cannot end a lexeme: text, then the token's rule
        lines.append(_text_without(fmt.trigger))
        lines.append(f"start: TEXT | TEXT {trigger} block_rest{more}")
    return "\n".join(lines) + "\n"


def _bounded(name: str, item: str, most: int) -> list[str]:
    """Rules `name_0` .. : at most `most` repeats of `item` (nested optionals, since a
    Lark `*` has no bound)."""
    lines = []
    for k in range(most):
        tail = f" {name}_{k + 1}" if k + 1 < most else ""
        lines.append(f"{name}_{k}: ({item}{tail})?")
    return lines


_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _text_without(text: str) -> str:
    """The TEXT terminal: any text that never contains `text`."""
    escaped = "".join("\\" + c if c in _REGEX_META else c for c in text)
    return f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{escaped}(.|\\n)*/"


def no_call_lark(fmt: ToolFormat) -> str:
    """`tool_choice: none`: any text that never contains the format's trigger, so the model
    cannot start a call even when the history shows it calls (a special-token trigger is
    kept out of free text by llguidance itself)."""
    return f"%llguidance {{}}\nstart: TEXT\n{_text_without(fmt.trigger)}\n"
