"""One request's tool calling: which tools, which choice, which format; builds the prompt,
the grammar and the parser from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ultrafast.grammar.spec import GrammarSpec
from ultrafast.server.prompt import ChatMessage
from ultrafast.server.tools.formats import GENERIC, ToolFormat, detect_format
from ultrafast.server.tools.grammar import (
    DEFAULT_MAX_CALLS,
    ToolSchema,
    no_call_lark,
    tool_call_lark,
)
from ultrafast.server.tools.parse import ToolCallParser
from ultrafast.server.tools.render import render_generic, render_native


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    # where its parameters' schema is in the request, under `tools` ("[1].function.parameters"):
    # a schema no arguments can match is a 400 naming the keyword's exact path
    param: str = field(default="", compare=False)

    def for_prompt(self) -> dict:
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return out


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[FunctionTool, ...]
    choice: str = "auto"  # none, auto, required, or "function" (then `named`)
    named: str | None = None
    parallel: bool = True
    # chat completions `stream_options.include_tool_call_done`: the fast path's side event
    done_events: bool = field(default=False, compare=False)
    fmt: ToolFormat = GENERIC  # set from the model's chat template (for_template)
    # the special tokens (text, id) inside the format's texts, in this model's vocabulary
    fmt_tokens: tuple[tuple[str, int], ...] = ()
    max_calls: int = DEFAULT_MAX_CALLS  # calls one turn may make (serve --max-tool-calls)
    asked_max_calls: int | None = None  # the request's own cap (Responses `max_tool_calls`)

    def for_template(
        self, chat_template: str | None, special_tokens: Mapping[str, int] | None = None
    ) -> ToolPlan:
        """The plan for one model: its chat template picks the format, its special tokens
        (Tokenizer.special_tokens) say which of the format's texts are single tokens."""
        fmt = detect_format(chat_template)
        found = fmt.special_tokens(special_tokens or {})
        return replace(self, fmt=fmt, fmt_tokens=tuple(sorted(found.items())))

    def capped(self, server_max: int) -> ToolPlan:
        """The plan under the server's cap (--max-tool-calls) and the request's own, the
        smaller: at 0 no call can be made (as `none`), at 1 the turn ends at its call."""
        asked = self.asked_max_calls
        most = server_max if asked is None else min(server_max, asked)
        if most <= 0:
            return replace(self, choice="none", named=None)
        return replace(self, max_calls=most, parallel=self.parallel and most > 1)

    @property
    def keep_token_ids(self) -> frozenset[int]:
        """Special tokens the output text must keep (the detokenizer skips the others): the
        format's own, which the parser reads calls by; none when no call may be made."""
        if not self.calls_allowed:
            return frozenset()
        return frozenset(i for _, i in self.fmt_tokens)

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def single(self) -> bool:
        """One call at most: generation ends at its closing brace."""
        return self.named is not None or not self.parallel

    def render(self, messages: list[ChatMessage]) -> tuple[list[ChatMessage], dict]:
        """The messages and template variables for the chat template. `none` shows no tools
        (the model cannot call any), but the history's calls are still rendered."""
        shown = [t.for_prompt() for t in self.tools] if self.calls_allowed else []
        if self.fmt.native:
            variables = {"tools": [{"type": "function", "function": f} for f in shown]}
            return render_native(messages), variables if shown else {}
        return render_generic(self.fmt, messages, shown), {}

    def grammar_lark(self, answer: tuple[str, list[str]] | None = None) -> str | None:
        """`answer`: the rule body (and its rules) a reply that is not a call must follow
        (the format the client asked for, e.g. a JSON schema); None: free text."""
        if not self.tools:
            return None
        if self.choice == "none":
            return no_call_lark(self.fmt)
        tools = [t for t in self.tools if self.named is None or t.name == self.named]
        return tool_call_lark(
            self.fmt,
            [ToolSchema(t.name, t.parameters, t.param) for t in tools],
            required=self.choice in ("required", "function"),
            single=self.single,
            tokens=dict(self.fmt_tokens),
            answer=answer,
            max_calls=self.max_calls,
        )

    def grammar(self, answer: GrammarSpec | None = None) -> GrammarSpec | None:
        """The reply's grammar. With `answer` (response_format / text.format) a reply that
        calls no tool follows it: tool calls OR the schema's JSON. `none` leaves the answer's
        own grammar (no call can start inside JSON)."""
        if answer is not None and not self.calls_allowed:
            return answer
        lark = self.grammar_lark(None if answer is None else answer.embedding())
        return None if lark is None else GrammarSpec(lark, "tools")

    def parser(self) -> ToolCallParser | None:
        return ToolCallParser(self.fmt) if self.calls_allowed else None


def chat_tool_plan(req: Any) -> ToolPlan | None:
    """From a validated ChatCompletionRequest (protocol.py checked names and schemas)."""
    if not req.tools:
        return None
    choice: str = "auto"
    named: str | None = None
    if isinstance(req.tool_choice, str):
        choice = req.tool_choice
    elif req.tool_choice is not None:
        choice, named = "function", req.tool_choice.function.name
    options = req.stream_options
    return ToolPlan(
        tools=tuple(
            FunctionTool(
                t.function.name,
                t.function.description,
                t.function.parameters,
                t.function.strict,
                f"[{i}].function.parameters",
            )
            for i, t in enumerate(req.tools)
        ),
        choice=choice,
        named=named,
        parallel=req.parallel_tool_calls is not False,
        done_events=bool(options and options.include_tool_call_done),
    )
