"""The OpenAI request fields we support, validated strictly (pydantic v2, strict types, no extras).

Types and presence come from the pydantic models; ranges and limits (S7 of RELIABILITY.md) are
checked after, in one place, so each refusal names the exact `param`. Unknown fields are
refused (never imported, evaluated or unpickled), client-sent templates included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Union

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from ultrafast.request import SamplingParams, ServiceTier
from ultrafast.server.errors import APIError, invalid_type, invalid_value, unsupported

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TIER_NAMES = ("auto", "default", "flex", "priority", "ultrafast")


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_tokens_cap: int = 4096
    max_n: int = 8
    max_prompt_chars: int = 1_000_000
    max_messages: int = 2048
    max_stops: int = 4
    max_stop_bytes: int = 256
    max_top_logprobs: int = 20
    max_logit_bias: int = 300
    max_tools: int = 128
    max_schema_bytes: int = 64 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    service_tier: Any = None
    priority: Any = None  # accepted alias of service_tier
    ignore_eos: bool = False
    metadata: dict[str, str] | None = None
    store: bool | None = None

    def requested_tier_name(self) -> str | None:
        return self.service_tier if self.service_tier is not None else self.priority

    def tier(self) -> ServiceTier:
        return ServiceTier.parse(self.requested_tier_name())

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def _top_logprobs(self) -> int:
        return 0

    def _wants_logprobs(self) -> bool:
        return False

    def sampling_params(self, vocab_size: int, max_tokens: int) -> SamplingParams:
        top_k = self.top_k if self.top_k and self.top_k > 0 else 0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k,
            min_p=self.min_p or 0.0, seed=self.seed,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            logprobs=self._wants_logprobs(), top_logprobs=self._top_logprobs(),
            ignore_eos=self.ignore_eos)


class ChatCompletionRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    prediction: dict | None = None
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    session_id: Any = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def _wants_logprobs(self) -> bool:
        return self.logprobs

    def _top_logprobs(self) -> int:
        return self.top_logprobs or 0

    def messages_for_template(self) -> list[dict]:
        out = []
        for m in self.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else \
                "".join(p.text or "" for p in m.content)
            item = {"role": m.role, "content": content or ""}
            if m.name:
                item["name"] = m.name
            if m.tool_calls:
                item["tool_calls"] = m.tool_calls
            if m.tool_call_id:
                item["tool_call_id"] = m.tool_call_id
            out.append(item)
        return out


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def _wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def _top_logprobs(self) -> int:
        return self.logprobs or 0

    def prompt_list(self) -> list:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# ---- pydantic errors -> OpenAI errors -------------------------------------------------------

def _param(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; union member tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "dict", "list") or "[" in part \
                or part.startswith(("function-", "literal", "union")):
            break
        else:
            out += ("." if out else "") + part
    return out


def _from_validation(exc: ValidationError) -> APIError:
    errors = exc.errors()
    missing = [e for e in errors if e["type"] == "missing"]
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        name = _param(extra[0]["loc"])
        return APIError(400, f"unknown parameter {name!r}", "invalid_request_error",
                        "unknown_parameter", name)
    if missing:
        name = _param(missing[0]["loc"])
        return APIError(400, f"missing required parameter {name!r}", "invalid_request_error",
                        "missing_required_field", name)
    first = errors[0]
    name = _param(first["loc"])
    if first["type"] == "literal_error" or ".role" in name or ".content" in name:
        return invalid_value(name, f"invalid value for {name!r}: {first['msg']}")
    return invalid_type(name, f"wrong type for {name!r}: {first['msg']}")


# ---- limits and ranges ----------------------------------------------------------------------

def _range(value, name: str, low, high, low_open: bool = False) -> None:
    if value is None:
        return
    bad = value <= low if low_open else value < low
    if bad or value > high:
        raise invalid_value(name, f"{name} must be in {'(' if low_open else '['}{low}, {high}]")


def _check_common(req: _Common, limits: Limits) -> None:
    max_tokens = req.requested_max_tokens()
    tokens_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) \
        is not None else "max_tokens"
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_tokens_cap:
        raise invalid_value(tokens_param, f"{tokens_param} must be between 1 and "
                            f"{limits.max_tokens_cap}")
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    if req.top_k is not None and req.top_k < -1:
        raise invalid_value("top_k", "top_k must be -1 or 0 (off) or a positive count")
    _range(req.min_p, "min_p", 0.0, 1.0)
    _range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _range(req.repetition_penalty, "repetition_penalty", 0.0, 10.0, low_open=True)
    if not 1 <= req.n <= limits.max_n:
        raise invalid_value("n", f"n must be between 1 and {limits.max_n}")
    stops = req.stop_list()
    if len(stops) > limits.max_stops:
        raise invalid_value("stop", f"at most {limits.max_stops} stop sequences")
    for s in stops:
        if not s or len(s.encode()) > limits.max_stop_bytes:
            raise invalid_value("stop", f"each stop sequence must be 1 to "
                                f"{limits.max_stop_bytes} bytes")
    if req.logit_bias is not None:
        if len(req.logit_bias) > limits.max_logit_bias:
            raise invalid_value("logit_bias", f"at most {limits.max_logit_bias} entries")
        for key, bias in req.logit_bias.items():
            if not key.isdigit() or int(key) >= limits.vocab_size:
                raise invalid_value("logit_bias", f"logit_bias key {key[:20]!r} is not a token "
                                    f"id in [0, {limits.vocab_size})")
            if not -100 <= bias <= 100:
                raise invalid_value("logit_bias", "logit_bias values must be in [-100, 100]")
    if req.stream_options is not None and not req.stream:
        raise invalid_value("stream_options", "stream_options is only allowed with stream: true")
    for field in ("service_tier", "priority"):
        value = getattr(req, field)
        if value is not None and (not isinstance(value, str) or value not in TIER_NAMES):
            raise invalid_value(field, f"{field} must be one of {', '.join(TIER_NAMES)}")
    if req.service_tier is not None and req.priority is not None and \
            ServiceTier.parse(req.service_tier) != ServiceTier.parse(req.priority):
        raise invalid_value("priority", "priority and service_tier disagree")


def _check_schema(schema: Any, param: str, limits: Limits) -> None:
    import jsonschema

    if len(orjson.dumps(schema)) > limits.max_schema_bytes:
        raise APIError(413, f"schema is larger than {limits.max_schema_bytes} bytes",
                       "invalid_request_error", "grammar_too_large", param)
    if not isinstance(schema, dict):
        raise invalid_value(param, "the schema must be a JSON object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise invalid_value(param, f"invalid JSON schema: {exc.message[:200]}") from None


def _check_chat(req: ChatCompletionRequest, limits: Limits) -> None:
    if not req.messages:
        raise invalid_value("messages", "messages must not be empty")
    if len(req.messages) > limits.max_messages:
        raise APIError(400, f"at most {limits.max_messages} messages", "invalid_request_error",
                       "too_many_messages", "messages")
    chars = 0
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"content part type {part.type[:20]!r} is not supported "
                                   "(this server does not fetch URLs or read files)",
                                   "invalid_request_error", "unsupported_content",
                                   f"messages[{i}].content[{j}]")
                chars += len(part.text)
        elif isinstance(m.content, str):
            chars += len(m.content)
    if chars > limits.max_prompt_chars:
        raise APIError(413, f"the messages exceed {limits.max_prompt_chars} characters",
                       "invalid_request_error", "prompt_too_large", "messages")
    if req.top_logprobs is not None:
        _range(req.top_logprobs, "top_logprobs", 0, limits.max_top_logprobs)
        if not req.logprobs:
            raise invalid_value("top_logprobs", "top_logprobs requires logprobs: true")
    if req.response_format is not None:
        _check_response_format(req.response_format, limits)
    if req.tools is not None:
        _check_tools(req.tools, limits)
    if req.session_id is not None:
        if not isinstance(req.session_id, str) or not NAME_RE.match(req.session_id):
            raise invalid_value("session_id", "session_id must match [A-Za-z0-9_-]{1,64}")
        raise unsupported("session_id", "server-side sessions are not available yet")
    if req.prediction is not None:
        raise unsupported("prediction", "predicted outputs are not available yet")


def _check_response_format(fmt: dict, limits: Limits) -> None:
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid_value("response_format", "json_schema needs {name, schema}")
        _check_schema(spec["schema"], "response_format", limits)
    elif kind != "json_object":
        raise invalid_value("response_format", "type must be text, json_object or json_schema")
    raise unsupported("response_format", "structured output is not available yet")


def _check_tools(tools: list[dict], limits: Limits) -> None:
    if len(tools) > limits.max_tools:
        raise invalid_value("tools", f"at most {limits.max_tools} tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise invalid_value(f"tools[{i}]", "each tool must be {type: function, function}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise invalid_value(f"tools[{i}].function.name",
                                "tool names must match [A-Za-z0-9_-]{1,64}")
        if "parameters" in fn:
            _check_schema(fn["parameters"], f"tools[{i}].function.parameters", limits)
    raise unsupported("tools", "tool calling is not available yet")


def _check_completion(req: CompletionRequest, limits: Limits) -> None:
    prompts = req.prompt_list()
    if not prompts:
        raise invalid_value("prompt", "prompt must not be empty")
    if len(prompts) * req.n > limits.max_n * 4:
        raise invalid_value("prompt", "too many prompts in one request")
    chars = 0
    for p in prompts:
        if isinstance(p, str):
            chars += len(p)
        elif any(not 0 <= t < limits.vocab_size for t in p):
            raise invalid_value("prompt", f"token id out of vocabulary [0, {limits.vocab_size})")
        elif not p:
            raise invalid_value("prompt", "a token-id prompt must not be empty")
    if chars > limits.max_prompt_chars:
        raise APIError(413, f"the prompt exceeds {limits.max_prompt_chars} characters",
                       "invalid_request_error", "prompt_too_large", "prompt")
    _range(req.logprobs, "logprobs", 0, limits.max_top_logprobs)
    if req.suffix is not None:
        raise unsupported("suffix", "suffix (fill-in-the-middle) is not supported")


def parse_chat_request(body: dict, limits: Limits) -> ChatCompletionRequest:
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _from_validation(exc) from None
    _check_common(req, limits)
    _check_chat(req, limits)
    return req


def parse_completion_request(body: dict, limits: Limits) -> CompletionRequest:
    try:
        req = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _from_validation(exc) from None
    _check_common(req, limits)
    _check_completion(req, limits)
    return req
