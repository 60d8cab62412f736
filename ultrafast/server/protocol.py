"""The OpenAI request fields we support for /v1/chat/completions and /v1/completions.

HTTP-independent: the input is the dict from `json_body.parse_json_body`, the output a request
model or an `APIError` whose `param` is an OpenAI-style path (`messages[0].role`). Two layers:
1. pydantic v2 models (protocol_models.py) decide shape and type: strict (`"100"`, `1.5` and
   `true` are not an int; an int is a float), `extra="forbid"` (any field we do not know is
   refused by name, never imported, evaluated or unpickled; client chat templates included,
   B37/B38). A top-level `null` means "not sent", as in OpenAI's API.
2. `_check_*` functions apply ranges and the S7 limits of RELIABILITY.md, one refusal each.
   A client's JSON Schema (`response_format`, a tool's `parameters`) is client_schema.py's.

Choices where the spec left room (also asserted in tests/unit/test_protocol.py):
- `n_probs` (B19) and `prompt_logprobs` (B20) are `unknown_parameter`: we do not offer them.
- `tools`, `response_format` other than text, and `session_id` are validated fully (B31-B36,
  B43) and then refused as `unsupported_parameter` unless `Limits.features` names them, so a
  server that has not wired a feature never silently ignores it. `prediction` is accepted
  always: it is a speed hint and never changes the output.
- Completions `suffix` is `unsupported_parameter`; `best_of` is accepted only as 1 (any other
  value is `unknown_parameter`, B37).
- OpenAI's hints (`safety_identifier`, `prompt_cache_key`, `prompt_cache_retention`,
  `reasoning_effort`, `verbosity`, `stream_options.include_obfuscation`) are accepted and
  validated; none changes the output (protocol_models.py says what each one does here).
- An integer field takes an integral float (`n: 2.0`); `2.5` is `invalid_type`.
- `top_p: 0` is greedy. `service_tier` takes OpenAI's whole enum: `fast` is priority, `scale`
  behaves as `auto` (the best tier the key may use now); the response names the tier served.
- Completions `max_tokens: 0` is allowed with `echo` (score the prompt, generate nothing);
  without `max_tokens` a completion is 16 tokens at most (the spec's default and vLLM's).
- A function tool without `parameters` (or with `{}`) takes no arguments: its calls carry `{}`.
- A schema error's `param` is the keyword's own path
  (`response_format.json_schema.schema.properties.zip.pattern`), the nesting limit's too.
- `max_completion_tokens` wins over `max_tokens` when both are sent.
- Text content parts are joined with "\\n" (as vLLM does).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from ultrafast.request import ServiceTier
from ultrafast.server.client_schema import check_client_schema
from ultrafast.server.errors import (
    bad_request,
    from_validation_error,
    invalid_type,
    invalid_value,
    missing_field,
    quote,
    too_large,
    unknown_parameter,
    unsupported_content,
    unsupported_parameter,
)
from ultrafast.server.protocol_models import (
    _MESSAGE_SHAPE,
    _TOKEN_ID,
    _UNION_TAGS,
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    MAX_MODEL_NAME_CHARS,
    MAX_PROMPT_CACHE_KEY_CHARS,
    MAX_SAFETY_IDENTIFIER_CHARS,
    MEDIA_PART_TYPES,
    NAME_RE,
    OPTIONAL_FEATURES,
    PROMPT_CACHE_RETENTIONS,
    REASONING_EFFORTS,
    VERBOSITIES,
    ChatCompletionRequest,
    CompletionRequest,
    ContentPart,
    Limits,
    Message,
    ResponseFormat,
    ToolChoiceFunction,
    _Common,
)

# ---- limits and ranges ----------------------------------------------------------------------


def _range(value, name: str, low, high, low_open: bool = False) -> None:
    if value is None:
        return
    if (value <= low if low_open else value < low) or value > high:
        raise invalid_value(name, f"{name} must be in {'(' if low_open else '['}{low}, {high}]")


def _require_feature(name: str, limits: Limits) -> None:
    if name not in limits.features:
        raise unsupported_parameter(name, f"{name} is not available on this server")


def _check_common(req: _Common, limits: Limits) -> None:
    scores_prompt = getattr(req, "echo", False)  # completions: max_tokens 0 scores the prompt
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name, None)
        low = 0 if scores_prompt and name == "max_tokens" else 1
        if value is not None and not low <= value <= limits.max_tokens_cap:
            raise invalid_value(
                name,
                f"{name} must be between {low} and "
                f"{limits.max_tokens_cap} (the cap for this key)"
                + (
                    ", or 0 with echo: true to score the prompt only"
                    if value == 0 and hasattr(req, "echo")
                    else ""
                ),
            )
    if req.model is not None and len(req.model) > MAX_MODEL_NAME_CHARS:
        raise invalid_value("model", f"model names are at most {MAX_MODEL_NAME_CHARS} chars")
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0)
    if req.top_k is not None and req.top_k < -1:
        raise invalid_value("top_k", "top_k must be -1 or 0 (off), or a positive count")
    _range(req.min_p, "min_p", 0.0, 1.0)
    _range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _range(req.repetition_penalty, "repetition_penalty", 0.0, 10.0, low_open=True)
    _range(req.n, "n", 1, limits.max_n)
    _range(req.seed, "seed", -(2**63), 2**64 - 1)
    _check_stop(req.stop_list(), limits)
    if req.logit_bias is not None:
        _check_logit_bias(req.logit_bias, limits)
    if req.stream_options is not None and not req.stream:
        raise invalid_value("stream_options", "stream_options is only allowed with stream: true")
    _check_tier(req)
    _check_hints(req)
    if req.metadata is not None:
        if len(req.metadata) > MAX_METADATA_PAIRS or any(
            len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
            for k, v in req.metadata.items()
        ):
            raise invalid_value(
                "metadata",
                f"metadata holds at most {MAX_METADATA_PAIRS} pairs,"
                f" keys <= {MAX_METADATA_KEY} and values <= "
                f"{MAX_METADATA_VALUE} chars",
            )


def _check_stop(stops: list[str], limits: Limits) -> None:
    if len(stops) > limits.max_stops:
        raise invalid_value("stop", f"at most {limits.max_stops} stop sequences")
    for s in stops:
        if not s or len(s.encode("utf-8", "surrogatepass")) > limits.max_stop_bytes:
            raise invalid_value(
                "stop", f"each stop sequence must be 1 to {limits.max_stop_bytes} bytes"
            )


def _check_logit_bias(bias: dict[str, Any], limits: Limits) -> None:
    if len(bias) > limits.max_logit_bias:
        raise invalid_value("logit_bias", f"logit_bias has at most {limits.max_logit_bias} entries")
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key) or int(key) >= limits.vocab_size:
            raise invalid_value(
                "logit_bias",
                f"logit_bias key {quote(key)} is not a token id in [0, {limits.vocab_size})",
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid_type("logit_bias", "logit_bias values must be numbers")
        if not -100 <= value <= 100:
            raise invalid_value("logit_bias", "logit_bias values must be in [-100, 100]")


def _check_hints(req: _Common) -> None:
    for name, cap in (
        ("safety_identifier", MAX_SAFETY_IDENTIFIER_CHARS),
        ("prompt_cache_key", MAX_PROMPT_CACHE_KEY_CHARS),
    ):
        value = getattr(req, name)
        if value is not None and not 1 <= len(value) <= cap:
            raise invalid_value(name, f"{name} must be 1 to {cap} characters")
    for name, allowed in (
        ("prompt_cache_retention", PROMPT_CACHE_RETENTIONS),
        ("reasoning_effort", REASONING_EFFORTS),
        ("verbosity", VERBOSITIES),
    ):
        value = getattr(req, name)
        if value is not None and value not in allowed:
            raise invalid_value(name, f"{name} must be one of {', '.join(allowed)}")


def _check_tier(req: _Common) -> None:
    tiers = {}
    for name in ("service_tier", "priority"):
        value = getattr(req, name)
        if value is None:
            continue
        try:
            tiers[name] = ServiceTier.parse(value if isinstance(value, str) else "?")
        except ValueError:
            raise invalid_value(
                name, f"{name} must be one of auto, default, flex, scale, priority, fast, ultrafast"
            ) from None
    if len(set(tiers.values())) > 1:
        raise invalid_value("priority", "priority and service_tier disagree")


# ---- chat -----------------------------------------------------------------------------------


def _check_message(i: int, m: Message) -> int:
    """Role rules and content parts of messages[i]; returns its size in characters."""
    at = f"messages[{i}]"
    if m.content is None and not (m.role == "assistant" and (m.tool_calls or m.refusal)):
        raise invalid_value(f"{at}.content", f"{at}.content is required for role '{m.role}'")
    if m.tool_calls and m.role != "assistant":
        raise invalid_value(f"{at}.tool_calls", "only assistant messages carry tool_calls")
    if m.role == "tool" and m.tool_call_id is None:
        raise missing_field(f"{at}.tool_call_id")
    if m.tool_call_id is not None and m.role != "tool":
        raise invalid_value(f"{at}.tool_call_id", "only tool messages carry tool_call_id")
    if isinstance(m.content, list):
        _check_parts(m.content, f"{at}.content")
    for j, call in enumerate(m.tool_calls or ()):
        _check_call_arguments(call.function.arguments, f"{at}.tool_calls[{j}].function.arguments")
    return len(m.text()) + sum(len(c.function.arguments) for c in m.tool_calls or ())


def _check_call_arguments(arguments: str, param: str) -> None:
    """A call's arguments in history must be a JSON object, as the model would have written."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise invalid_value(param, "a tool call's arguments must be a JSON object (as a string)")


def _check_parts(parts: list[ContentPart], at: str) -> None:
    for j, part in enumerate(parts):
        where = f"{at}[{j}]"
        if part.type in MEDIA_PART_TYPES:
            raise unsupported_content(
                where,
                f"content parts of type '{part.type}' are not "
                "supported: this server does not fetch URLs or files",
            )
        if part.type != "text":
            raise invalid_value(f"{where}.type", f"unknown content part type {quote(part.type)}")
        if part.text is None:
            raise missing_field(f"{where}.text")
        if part.model_extra:
            raise unknown_parameter(f"{where}.{next(iter(part.model_extra))[:64]}")


def _check_chat(req: ChatCompletionRequest, limits: Limits) -> None:
    if not req.messages:
        raise invalid_value("messages", "messages must not be empty")
    num_chars = sum(_check_message(i, m) for i, m in enumerate(req.messages))
    if num_chars > limits.max_prompt_chars:
        raise too_large(
            "prompt_too_large",
            "messages",
            f"the messages exceed {limits.max_prompt_chars} characters",
        )
    _range(req.top_logprobs, "top_logprobs", 0, limits.max_top_logprobs)
    if req.top_logprobs and not req.logprobs:
        raise invalid_value("top_logprobs", "top_logprobs requires logprobs: true")
    if req.prediction is not None:
        if isinstance(req.prediction.content, list):
            _check_parts(req.prediction.content, "prediction.content")
        if len(req.prediction_text() or "") > limits.max_prompt_chars:
            raise too_large(
                "prompt_too_large",
                "prediction",
                f"the prediction exceeds {limits.max_prompt_chars} characters",
            )
    if req.response_format is not None:
        _check_response_format(req.response_format, limits)
    _check_tools(req, limits)
    if req.session_id is not None:
        if not isinstance(req.session_id, str) or not NAME_RE.fullmatch(req.session_id):
            raise invalid_value("session_id", "session_id must match [A-Za-z0-9_-]{1,64}")
        _require_feature("session_id", limits)


def _check_response_format(fmt: ResponseFormat, limits: Limits) -> None:
    if fmt.type == "text":
        return
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid_value(
                "response_format", "type json_schema needs json_schema: {name, schema}"
            )
        name = fmt.json_schema.name
        if name is not None and not NAME_RE.fullmatch(name):
            raise invalid_value(
                "response_format", "json_schema.name must match [A-Za-z0-9_-]{1,64}"
            )
        check_client_schema(
            fmt.json_schema.schema_, "response_format", limits, "response_format.json_schema.schema"
        )
    elif fmt.json_schema is not None:
        raise invalid_value("response_format", "json_schema is only allowed with type json_schema")
    _require_feature("response_format", limits)


def _check_tools(req: ChatCompletionRequest, limits: Limits) -> None:
    tools = req.tools or []
    if len(tools) > limits.max_tools:
        raise invalid_value("tools", f"at most {limits.max_tools} tools")
    names = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not NAME_RE.fullmatch(name) or name in names:
            raise invalid_value(
                f"tools[{i}].function.name",
                "tool names must be unique and match [A-Za-z0-9_-]{1,64}",
            )
        names.add(name)
        if tool.function.parameters is not None:
            param = f"tools[{i}].function.parameters"
            check_client_schema(tool.function.parameters, param, limits, param)
            if tool.function.parameters.get("type", "object") != "object":
                raise invalid_value(param, "a tool's parameters must describe a JSON object")
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction) and choice.function.name not in names:
        raise invalid_value(
            "tool_choice", f"tool_choice names {quote(choice.function.name)}, which is not in tools"
        )
    if choice == "required" and not tools:
        raise invalid_value("tool_choice", "tool_choice 'required' needs tools")
    if tools:
        _require_feature("tools", limits)


# ---- completions ----------------------------------------------------------------------------


def _check_prompt(prompt: Any, limits: Limits) -> list:
    """str | list[int] | a batch: a list whose entries are each a str or a list[int] (mixing
    is allowed, as in vLLM). Bools are never token ids."""

    def is_ids(x):
        return isinstance(x, list) and all(type(t) is int for t in x)

    if isinstance(prompt, str) or is_ids(prompt) and prompt:
        prompts = [prompt]
    elif (
        isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt)
    ):
        prompts = prompt
    elif prompt == []:
        raise invalid_value("prompt", "prompt must not be empty")
    else:
        raise invalid_type(
            "prompt",
            "prompt must be a string, a list of strings, a list of "
            "token ids or a list of lists of token ids",
        )
    num_chars = 0
    for p in prompts:
        if isinstance(p, str):
            num_chars += len(p)
            continue
        if not p:
            raise invalid_value("prompt", "a token-id prompt must not be empty")
        if min(p) < 0 or max(p) >= limits.vocab_size:
            raise invalid_value("prompt", f"token id out of vocabulary [0, {limits.vocab_size})")
        num_chars += len(p)
    if num_chars > limits.max_prompt_chars:
        raise too_large(
            "prompt_too_large", "prompt", f"the prompt exceeds {limits.max_prompt_chars} characters"
        )
    return prompts


def _check_completion(req: CompletionRequest, limits: Limits) -> None:
    prompts = _check_prompt(req.prompt, limits)
    if len(prompts) * req.n > limits.max_choices:
        raise invalid_value("prompt", f"prompts x n is at most {limits.max_choices}")
    _range(req.logprobs, "logprobs", 0, limits.max_top_logprobs)
    if req.suffix is not None:
        raise unsupported_parameter("suffix", "suffix (fill-in-the-middle) is not supported")
    if req.best_of is not None and req.best_of != 1:  # B37: as if the field were unknown
        raise bad_request(
            "unknown_parameter",
            "best_of",
            "best_of is only accepted as 1: "
            "each choice is returned as sampled (ask for more with n)",
        )


# ---- entry points ---------------------------------------------------------------------------


def _validate(model: type[BaseModel], body: Any, limits: Limits):
    if not isinstance(body, dict):
        raise invalid_value(None, "the body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means "not sent"
    # Counts first, so an oversized list is refused before pydantic walks it.
    for name, cap, code in (
        ("messages", limits.max_messages, "too_many_messages"),
        ("tools", limits.max_tools, "invalid_value"),
    ):
        if isinstance(body.get(name), list) and len(body[name]) > cap:
            raise bad_request(code, name, f"{name} has at most {cap} entries")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = from_validation_error(exc, body, _UNION_TAGS)
    if error.code == "invalid_type" and error.param and _MESSAGE_SHAPE.fullmatch(error.param):
        error.code = "invalid_value"  # B9: a bad role or content is a bad value of a message
    raise error


def parse_chat_request(body: dict, limits: Limits) -> ChatCompletionRequest:
    req = _validate(ChatCompletionRequest, body, limits)
    _check_common(req, limits)
    _check_chat(req, limits)
    return req


def parse_completion_request(body: dict, limits: Limits) -> CompletionRequest:
    req = _validate(CompletionRequest, body, limits)
    _check_common(req, limits)
    _check_completion(req, limits)
    return req


# what callers import from here: the entry points, plus the models and limits they return
__all__ = [
    "Limits",
    "OPTIONAL_FEATURES",
    "ChatCompletionRequest",
    "CompletionRequest",
    "parse_chat_request",
    "parse_completion_request",
]
