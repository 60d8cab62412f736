"""Ollama's `/api/chat` and `/api/generate` requests, translated into a `CallInput`.

`options` are checked by name and JSON type (400 naming `options.<name>`): temperature,
top_p, top_k, min_p, seed, stop, num_predict (-1 and -2: the context left, capped),
repeat_penalty, presence_penalty, frequency_penalty; num_ctx is accepted (an int >= 1) but
the context is the server's; Ollama's runner options (num_thread, num_gpu, mirostat, ...) are
accepted and ignored; any other name is refused. Options left out take the model's own
defaults (as every protocol here), not Ollama's. `format` ("json" or a JSON schema) goes
through the same grammar path as `response_format`. `images` are refused: text models only.
A top-level `service_tier` (this server's tier names) is an extension; Ollama has none.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from ultrafast.request import SamplingChoice, ServiceTier
from ultrafast.server.calls import CallInput, plain_params
from ultrafast.server.client_schema import check_client_schema
from ultrafast.server.errors import invalid_type, invalid_value, unsupported_content
from ultrafast.server.frontends.common import ToolSpec, tool_plan, validated
from ultrafast.server.prompt import ChatMessage
from ultrafast.server.protocol import Limits, _require_feature
from ultrafast.server.protocol_models import StrictModel
from ultrafast.server.structured import json_format_grammar

FLOAT_OPTIONS = (
    "temperature",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
)
INT_OPTIONS = ("top_k", "seed", "num_predict", "num_ctx")
IGNORED_OPTIONS = frozenset(
    "num_keep typical_p repeat_last_n tfs_z mirostat mirostat_tau mirostat_eta "
    "penalize_newline numa num_batch num_gpu main_gpu low_vram vocab_only use_mmap use_mlock "
    "num_thread f16_kv logits_all embedding_only rope_frequency_base rope_frequency_scale "
    "num_gqa".split()
)


class ToolFunction(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: ToolFunction


class CallFunction(StrictModel):
    name: str
    arguments: dict[str, Any]
    index: int | None = None


class ToolCall(StrictModel):
    function: CallFunction
    id: str | None = None


class Message(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Common(StrictModel):
    model: str
    format: Any = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: Any = None
    think: Any = None
    service_tier: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = []
    tools: list[Tool] | None = None


class GenerateRequest(_Common):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[Any] | None = None
    context: list[int] | None = None


def parse(model, body: Any, limits: Limits):
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if v is not None}
    req = validated(model, body)
    if isinstance(req, ChatRequest) and len(req.messages) > limits.max_messages:
        raise invalid_value("messages", f"at most {limits.max_messages} messages")
    if req.think not in (None, False):
        raise invalid_value("think", "this model does not think")
    if isinstance(req, GenerateRequest):
        _check_generate(req)
    return req


def _check_generate(req: GenerateRequest) -> None:
    if req.images:
        raise unsupported_content(
            "images", "images are not supported: this server serves text models"
        )
    if req.suffix:
        raise invalid_value("suffix", "suffix (fill-in-the-middle) is not available on this server")
    if req.template:
        raise invalid_value("template", "a custom template is not available; the model's is used")
    if req.context:
        raise invalid_value("context", "context is not available on this server; use /api/chat")


def chat_messages(req: ChatRequest) -> list[ChatMessage]:
    """Ollama's messages; calls get ids, and a tool turn answers the latest call of its name."""
    out: list[ChatMessage] = []
    last_call_of: dict[str, str] = {}
    for i, m in enumerate(req.messages):
        if m.images:
            raise unsupported_content(
                f"messages[{i}].images", "images are not supported: this server serves text models"
            )
        extra: dict[str, Any] = {}
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                call_id = call.id or f"call_{i}_{j}"
                last_call_of[call.function.name] = call_id
                arguments = json.dumps(
                    call.function.arguments, ensure_ascii=False, separators=(",", ":")
                )
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            extra["tool_calls"] = calls
        if m.role == "tool":
            answered = last_call_of.get(m.tool_name or "")
            if answered is not None:
                extra["tool_call_id"] = answered
        out.append(ChatMessage(m.role, m.content, extra=extra))
    if out and out[-1].role == "assistant":  # a prefill would be answered as a whole turn
        raise invalid_value(
            f"messages[{len(out) - 1}].role",
            "the last message must not be the assistant's: continuing an assistant turn "
            "is not available on this server",
        )
    return out


def generate_messages(req: GenerateRequest) -> list[ChatMessage]:
    system = [ChatMessage("system", req.system)] if req.system else []
    return [*system, ChatMessage("user", req.prompt)]


def _number(options: dict, name: str, integer: bool) -> Any:
    value = options[name]
    ok = type(value) is int or (not integer and type(value) is float)
    if integer and type(value) is float and value.is_integer():
        value, ok = int(value), True
    if not ok:
        kind = "an integer" if integer else "a number"
        raise invalid_type(f"options.{name}", f"options.{name} must be {kind}")
    return value


def sampling(options: dict | None, limits: Limits) -> tuple[SamplingChoice, int | None, list[str]]:
    """(params with the options applied, max_tokens or None, stop strings)."""
    options = options or {}
    for name in options:
        if name not in FLOAT_OPTIONS + INT_OPTIONS + ("stop",) and name not in IGNORED_OPTIONS:
            raise invalid_value(f"options.{name}", f"unknown option {name!r}")
    got = {
        n: _number(options, n, n in INT_OPTIONS)
        for n in FLOAT_OPTIONS + INT_OPTIONS
        if n in options
    }
    stop = options.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid_type("options.stop", "options.stop must be a list of non-empty strings")
    if len(stop) > 16 or any(len(s.encode()) > limits.max_stop_bytes for s in stop):
        raise invalid_value(
            "options.stop", f"at most 16 stop strings of {limits.max_stop_bytes} bytes"
        )
    changes = {
        "min_p": got.get("min_p"),
        "top_k": got.get("top_k"),
        "seed": got.get("seed"),
        "repetition_penalty": got.get("repeat_penalty"),
        "presence_penalty": got.get("presence_penalty"),
        "frequency_penalty": got.get("frequency_penalty"),
    }
    if changes["top_k"] is not None and changes["top_k"] >= limits.vocab_size:
        changes["top_k"] = 0
    try:
        params = plain_params(got.get("temperature"), got.get("top_p"), limits)
        params = replace(params, **{k: v for k, v in changes.items() if v is not None})
    except ValueError as exc:  # SamplingChoice's own range checks: "<field> must be ..."
        field = str(exc).split(" ")[0]
        name = {"repetition_penalty": "repeat_penalty"}.get(field, field)
        raise invalid_value(f"options.{name}", str(exc)) from None
    return params, _max_tokens(got, limits), stop


def _max_tokens(got: dict, limits: Limits) -> int | None:
    if got.get("num_ctx") is not None and got["num_ctx"] < 1:
        raise invalid_value("options.num_ctx", "options.num_ctx must be >= 1")
    num = got.get("num_predict")
    if num is None or num in (-1, -2):
        return None
    if not 1 <= num <= limits.max_tokens_cap:
        raise invalid_value(
            "options.num_predict",
            f"options.num_predict must be -1, -2 or between 1 and {limits.max_tokens_cap}",
        )
    return num


def _grammar(fmt: Any, limits: Limits):
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        grammar = json_format_grammar("json_object")
    elif isinstance(fmt, dict):
        check_client_schema(fmt, "format", limits, "format")
        grammar = json_format_grammar("json_schema", fmt, True)
    else:
        raise invalid_value("format", 'format must be "json" or a JSON schema object')
    _require_feature("response_format", limits)
    return grammar


def _tier(name: str | None, default_tier: ServiceTier) -> tuple[ServiceTier, bool]:
    if name is None:
        return default_tier, False
    try:
        return ServiceTier.parse(name), name == "auto"
    except ValueError:
        raise invalid_value(
            "service_tier", "service_tier must be auto, default, flex or priority"
        ) from None


def call_input(
    req: Any,
    model: str,
    limits: Limits,
    request_id: str,
    default_tier: ServiceTier = ServiceTier.DEFAULT,
) -> CallInput:
    """`default_tier`: the tier when the request names none (the key's, common.key_tier)."""
    params, max_tokens, stops = sampling(req.options, limits)
    grammar = _grammar(req.format, limits)
    if grammar is not None:
        params = replace(params, grammar=grammar)
    tier, auto = _tier(req.service_tier, default_tier)
    chat = isinstance(req, ChatRequest)
    raw = not chat and req.raw
    plan = None
    if chat and req.tools:
        specs = [
            ToolSpec(t.function.name, t.function.description, t.function.parameters)
            for t in req.tools
        ]
        plan = tool_plan(specs, "tools", limits, schema_field="function.parameters")
    return CallInput(
        chat=not raw,
        params=params,
        max_tokens=max_tokens,
        messages=[] if raw else chat_messages(req) if chat else generate_messages(req),
        prompts=[req.prompt] if raw else [],
        model=model,
        stream=req.stream,
        stops=stops,
        tier=tier,
        auto_tier=auto,
        request_id=request_id,
        tools=plan,
        keep_alive=req.keep_alive,
        prompt_param="messages" if chat else "prompt",
        max_tokens_param="options.num_predict",
        grammar_param="format",
    )
