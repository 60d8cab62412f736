"""What the protocol front ends share: validation with field paths in the client's own terms,
and a tool plan (server/tools/plan.py) from a protocol's function list."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ultrafast.request import ServiceTier
from ultrafast.server import auth
from ultrafast.server.calls import template_error
from ultrafast.server.client_schema import check_client_schema
from ultrafast.server.errors import from_validation_error, invalid_value
from ultrafast.server.prompt import ChatMessage, encode_chat
from ultrafast.server.protocol import Limits, _require_feature
from ultrafast.server.protocol_models import NAME_RE
from ultrafast.server.tools.plan import FunctionTool, ToolPlan
from ultrafast.tokenizer import ChatTemplateError

UNION_TAGS = frozenset({"string", "array", "object"})


def validated(model: type[BaseModel], value: Any, at: str | None = None):
    """`model` from `value`, or the 400 naming the field (`at` leads the path)."""
    if not isinstance(value, dict):
        raise invalid_value(at, f"{at or 'the body'} must be a JSON object")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        error = from_validation_error(exc, value, UNION_TAGS)
        if at is not None:
            inner = error.param
            error.param = at if inner is None else f"{at}.{inner}"
            if inner is not None:
                error.message = error.message.replace(f"'{inner}'", f"'{error.param}'")
        raise error from None


@dataclass(frozen=True)
class ToolSpec:
    """One function tool as a protocol spells it: its name, description and JSON schema."""

    name: Any
    description: Any
    schema: Any


def tool_plan(
    specs: list[ToolSpec],
    at: str,
    limits: Limits,
    *,
    choice: str = "auto",
    named: str | None = None,
    parallel: bool = True,
    schema_field: str = "parameters",
) -> ToolPlan | None:
    """Check names and schemas (400 at `{at}[i].name` / `{at}[i].{schema_field}`)."""
    if not specs:
        return None
    if len(specs) > limits.max_tools:
        raise invalid_value(at, f"at most {limits.max_tools} tools")
    tools, names = [], set()
    for i, spec in enumerate(specs):
        if (
            not isinstance(spec.name, str)
            or not NAME_RE.fullmatch(spec.name)
            or (spec.name in names)
        ):
            raise invalid_value(
                f"{at}[{i}].name", "tool names must be unique and match [A-Za-z0-9_-]{1,64}"
            )
        names.add(spec.name)
        schema = spec.schema
        if schema is not None:
            param = f"{at}[{i}].{schema_field}"
            if not isinstance(schema, dict):
                raise invalid_value(param, "a tool's schema must be a JSON object")
            check_client_schema(schema, param, limits, param)
            if schema.get("type", "object") != "object":
                raise invalid_value(param, "a tool's schema must describe a JSON object")
        description = spec.description if isinstance(spec.description, str) else None
        tools.append(FunctionTool(spec.name, description, schema, param=f"[{i}].{schema_field}"))
    _require_feature("tools", limits)
    if named is not None and named not in names:
        raise invalid_value("tool_choice", f"tool_choice names {named!r}, which is not in tools")
    return ToolPlan(tools=tuple(tools), choice=choice, named=named, parallel=parallel)


async def count_prompt_tokens(
    tokenizer, pool, messages: list[ChatMessage], plan: ToolPlan | None, param: str
) -> int:
    """The prompt's length as the pipeline would tokenize it (template, tools, chat_tokens)."""
    template_vars: dict = {}
    if plan is not None:
        plan = plan.for_template(tokenizer.chat_template, tokenizer.special_tokens)
        messages, template_vars = plan.render(messages)
    try:
        ids = await asyncio.get_running_loop().run_in_executor(
            pool, encode_chat, tokenizer, messages, template_vars
        )
    except ChatTemplateError as exc:
        raise template_error(exc, param) from None
    return len(ids)


def key_tier(scope) -> ServiceTier:
    """The tier a call that names none runs on: the key's default. Anthropic's and Ollama's
    clients rarely can name this server's tiers, so a key allowed only flex (or only
    priority) serves there instead of being refused; a key with the default tier (and the
    anonymous tenant) gets the default tier, as on OpenAI's routes. A key whose entry in the
    keys file names a `default_tier` gets that one."""
    named = auth.key_default_tier(scope)
    if named is not None:
        return named
    tiers = auth.tenant_of(scope).tiers
    for tier in (ServiceTier.DEFAULT, ServiceTier.FLEX, ServiceTier.PRIORITY):
        if tier in tiers:
            return tier
    return ServiceTier.DEFAULT
