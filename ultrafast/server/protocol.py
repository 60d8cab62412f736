"""The OpenAI request fields we support for /v1/chat/completions and /v1/completions.

HTTP-independent: the input is the dict from `json_body.parse_json_body`, the output a request
model or an `APIError` whose `param` is an OpenAI-style path (`messages[0].role`). Two layers:
1. pydantic v2 models decide shape and type: strict (`"100"`, `1.5` and `true` are not an int;
   an int is a float), `extra="forbid"` (any field we do not know is refused by name, never
   imported, evaluated or unpickled; client chat templates included, B37/B38). A top-level
   `null` means "not sent", as in OpenAI's API.
2. `_check_*` functions apply ranges and the S7 limits of RELIABILITY.md, one refusal each.

Choices where the spec left room (also asserted in tests/unit/test_protocol.py):
- `n_probs` (B19) and `prompt_logprobs` (B20) are `unknown_parameter`: we do not offer them.
- `tools`, `response_format` other than text, and `session_id` are validated fully (B31-B36,
  B43) and then refused as `unsupported_parameter` unless `Limits.features` names them, so a
  server that has not wired a feature never silently ignores it. `prediction` is accepted
  always: it is a speed hint and never changes the output.
- Completions `suffix` is `unsupported_parameter`.
- `max_completion_tokens` wins over `max_tokens` when both are sent.
- Text content parts are joined with "\\n" (as vLLM does).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

import jsonschema
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from ultrafast.request import SamplingParams, ServiceTier
from ultrafast.server.errors import (bad_request, from_validation_error, invalid_type,
                                     invalid_value, missing_field, quote, too_large,
                                     unknown_parameter, unsupported_content,
                                     unsupported_parameter)

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # always fullmatch: `$` would accept a final \n
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # canonical, so "1" and "01" cannot both appear
OPTIONAL_FEATURES = frozenset({"tools", "response_format", "session_id"})
# Media parts are refused by name (B39): this server never fetches a URL or reads a file.
MEDIA_PART_TYPES = frozenset({"image_url", "input_image", "image", "input_audio", "audio_url",
                              "video_url", "file", "input_file"})
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MAX_MODEL_NAME_CHARS = 256  # the name is echoed in a 404; keep that small


@dataclass(frozen=True)
class Limits:
    """S7 of RELIABILITY.md; `vocab_size` comes from the tokenizer, the rest are defaults."""

    vocab_size: int
    max_tokens_cap: int = 4096  # per-key cap on max_tokens / max_completion_tokens
    max_n: int = 8
    max_prompt_chars: int = 1_000_000  # before tokenizing (also caps token-id prompts)
    max_messages: int = 2048
    max_stops: int = 4
    max_stop_bytes: int = 256
    max_top_logprobs: int = 20
    max_logit_bias: int = 300
    max_tools: int = 128
    max_schema_bytes: int = 64 * 1024
    max_choices: int = 32  # completions: number of prompts x n
    features: frozenset = frozenset()  # which of OPTIONAL_FEATURES the server has wired


# ---- models ---------------------------------------------------------------------------------

def _json_type(value: Any) -> str:
    """Union members are picked by JSON type, so a failure is reported once, for the member
    the client meant, instead of once per member."""
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else "?"


_UNION_TAGS = frozenset({"string", "array", "object"})
_MESSAGE_SHAPE = re.compile(r"messages\[\d+\]\.(role|content)(\[\d+\].*)?")


def _by_json_type(**members: Any) -> Any:
    return Annotated[Union[tuple(Annotated[t, Tag(k)] for k, t in members.items())],
                     Discriminator(_json_type)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ContentPart(BaseModel):
    # Extra keys pass pydantic only so media parts reach the check that names them (B39).
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None


Content = _by_json_type(string=str, array=list[ContentPart])


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Content] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool = False


class Prediction(_Strict):
    type: Literal["content"]
    content: Content


class FunctionDef(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Any = None  # a JSON Schema, checked by jsonschema (B35)
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceName(_Strict):
    name: str


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    function: ToolChoiceName


class JsonSchemaFormat(_Strict):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Any = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class _Common(_Strict):
    """Fields both endpoints share, and what they turn into for the engine."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = 1
    stop: Optional[_by_json_type(string=str, array=list[str])] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, Any]] = None  # values checked by hand: one param for all
    user: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    service_tier: Any = None  # checked by hand: 1e9 is invalid_value, not invalid_type (B42)
    priority: Any = None  # accepted alias of service_tier
    ignore_eos: bool = False
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None

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

    def _logprobs(self) -> tuple[bool, int]:
        return False, 0

    def sampling_params(self, vocab_size: int, default_max_tokens: int) -> SamplingParams:
        """`default_max_tokens` is used when the client sent no limit; the server picks it
        (min of the per-key cap and the context left after the prompt)."""
        requested = self.requested_max_tokens()
        top_k = self.top_k if self.top_k is not None and 0 < self.top_k < vocab_size else 0
        logprobs, top_logprobs = self._logprobs()
        bias = sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
        return SamplingParams(
            max_tokens=default_max_tokens if requested is None else requested,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k,
            min_p=self.min_p or 0.0, seed=self.seed,
            repetition_penalty=1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=tuple((k, v) for k, v in bias if k < vocab_size),
            logprobs=logprobs, top_logprobs=top_logprobs, ignore_eos=self.ignore_eos)


class ChatCompletionRequest(_Common):
    messages: list[Message]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    prediction: Optional[Prediction] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[_by_json_type(string=Literal["none", "auto", "required"],
                                        object=ToolChoiceFunction)] = None
    parallel_tool_calls: Optional[bool] = None
    session_id: Any = None  # checked by hand against NAME_RE (B43)

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def _logprobs(self) -> tuple[bool, int]:
        return self.logprobs, self.top_logprobs or 0

    def messages_for_template(self) -> list[dict]:
        """Plain dicts for the chat template: content parts joined to one string."""
        out = []
        for m in self.messages:
            item: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                item["name"] = m.name
            if m.tool_calls:
                item["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                item["tool_call_id"] = m.tool_call_id
            out.append(item)
        return out

    def tools_for_template(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def prediction_text(self) -> str | None:
        if self.prediction is None:
            return None
        content = self.prediction.content
        return content if isinstance(content, str) else "".join(p.text or "" for p in content)


class CompletionRequest(_Common):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by hand (B24)
    logprobs: Optional[int] = None  # number of top alternatives, 0..20
    echo: bool = False
    suffix: Optional[str] = None

    def _logprobs(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def prompt_list(self) -> list:
        """One entry per prompt: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


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
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name, None)
        if value is not None and not 1 <= value <= limits.max_tokens_cap:
            raise invalid_value(name, f"{name} must be between 1 and {limits.max_tokens_cap} "
                                f"(the cap for this key)")
    if req.model is not None and len(req.model) > MAX_MODEL_NAME_CHARS:
        raise invalid_value("model", f"model names are at most {MAX_MODEL_NAME_CHARS} chars")
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    if req.top_k is not None and req.top_k < -1:
        raise invalid_value("top_k", "top_k must be -1 or 0 (off), or a positive count")
    _range(req.min_p, "min_p", 0.0, 1.0)
    _range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _range(req.repetition_penalty, "repetition_penalty", 0.0, 10.0, low_open=True)
    _range(req.n, "n", 1, limits.max_n)
    _range(req.seed, "seed", -2 ** 63, 2 ** 64 - 1)
    _check_stop(req.stop_list(), limits)
    if req.logit_bias is not None:
        _check_logit_bias(req.logit_bias, limits)
    if req.stream_options is not None and not req.stream:
        raise invalid_value("stream_options", "stream_options is only allowed with stream: true")
    _check_tier(req)
    if req.metadata is not None:
        if len(req.metadata) > MAX_METADATA_PAIRS or any(
                len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                for k, v in req.metadata.items()):
            raise invalid_value("metadata", f"metadata holds at most {MAX_METADATA_PAIRS} pairs,"
                                f" keys <= {MAX_METADATA_KEY} and values <= "
                                f"{MAX_METADATA_VALUE} chars")


def _check_stop(stops: list[str], limits: Limits) -> None:
    if len(stops) > limits.max_stops:
        raise invalid_value("stop", f"at most {limits.max_stops} stop sequences")
    for s in stops:
        if not s or len(s.encode("utf-8", "surrogatepass")) > limits.max_stop_bytes:
            raise invalid_value("stop", f"each stop sequence must be 1 to "
                                f"{limits.max_stop_bytes} bytes")


def _check_logit_bias(bias: dict[str, Any], limits: Limits) -> None:
    if len(bias) > limits.max_logit_bias:
        raise invalid_value("logit_bias", f"logit_bias has at most {limits.max_logit_bias} "
                            "entries")
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key) or int(key) >= limits.vocab_size:
            raise invalid_value("logit_bias", f"logit_bias key {quote(key)} is not a token id "
                                f"in [0, {limits.vocab_size})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid_type("logit_bias", "logit_bias values must be numbers")
        if not -100 <= value <= 100:
            raise invalid_value("logit_bias", "logit_bias values must be in [-100, 100]")


def _check_tier(req: _Common) -> None:
    tiers = {}
    for name in ("service_tier", "priority"):
        value = getattr(req, name)
        if value is None:
            continue
        try:
            tiers[name] = ServiceTier.parse(value if isinstance(value, str) else "?")
        except ValueError:
            raise invalid_value(name, f"{name} must be one of auto, default, flex, priority, "
                                "ultrafast") from None
    if len(set(tiers.values())) > 1:
        raise invalid_value("priority", "priority and service_tier disagree")


def _check_schema(schema: Any, param: str, limits: Limits) -> None:
    size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass"))
    if size > limits.max_schema_bytes:
        raise too_large("grammar_too_large", param,
                        f"the schema is {size} bytes; the limit is {limits.max_schema_bytes}")
    if not isinstance(schema, dict):
        raise invalid_value(param, "a JSON Schema must be an object")
    try:
        validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
        validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise invalid_value(param, f"not a valid JSON Schema: {exc.message[:200]}") from None
    except RecursionError:
        raise invalid_value(param, "the schema is nested too deeply") from None


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
    return len(m.text()) + sum(len(c.function.arguments) for c in m.tool_calls or ())


def _check_parts(parts: list[ContentPart], at: str) -> None:
    for j, part in enumerate(parts):
        where = f"{at}[{j}]"
        if part.type in MEDIA_PART_TYPES:
            raise unsupported_content(where, f"content parts of type '{part.type}' are not "
                                      "supported: this server does not fetch URLs or files")
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
        raise too_large("prompt_too_large", "messages",
                        f"the messages exceed {limits.max_prompt_chars} characters")
    _range(req.top_logprobs, "top_logprobs", 0, limits.max_top_logprobs)
    if req.top_logprobs and not req.logprobs:
        raise invalid_value("top_logprobs", "top_logprobs requires logprobs: true")
    if req.prediction is not None:
        if isinstance(req.prediction.content, list):
            _check_parts(req.prediction.content, "prediction.content")
        if len(req.prediction_text()) > limits.max_prompt_chars:
            raise too_large("prompt_too_large", "prediction",
                            f"the prediction exceeds {limits.max_prompt_chars} characters")
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
            raise invalid_value("response_format", "type json_schema needs "
                                "json_schema: {name, schema}")
        name = fmt.json_schema.name
        if name is not None and not NAME_RE.fullmatch(name):
            raise invalid_value("response_format", "json_schema.name must match "
                                "[A-Za-z0-9_-]{1,64}")
        _check_schema(fmt.json_schema.schema_, "response_format", limits)
    elif fmt.json_schema is not None:
        raise invalid_value("response_format", "json_schema is only allowed with "
                            "type json_schema")
    _require_feature("response_format", limits)


def _check_tools(req: ChatCompletionRequest, limits: Limits) -> None:
    tools = req.tools or []
    if len(tools) > limits.max_tools:
        raise invalid_value("tools", f"at most {limits.max_tools} tools")
    names = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not NAME_RE.fullmatch(name) or name in names:
            raise invalid_value(f"tools[{i}].function.name", "tool names must be unique and "
                                "match [A-Za-z0-9_-]{1,64}")
        names.add(name)
        if tool.function.parameters is not None:
            _check_schema(tool.function.parameters, f"tools[{i}].function.parameters", limits)
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction) and choice.function.name not in names:
        raise invalid_value("tool_choice", f"tool_choice names {quote(choice.function.name)},"
                            " which is not in tools")
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
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p)
                                                     for p in prompt):
        prompts = prompt
    elif prompt == []:
        raise invalid_value("prompt", "prompt must not be empty")
    else:
        raise invalid_type("prompt", "prompt must be a string, a list of strings, a list of "
                           "token ids or a list of lists of token ids")
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
        raise too_large("prompt_too_large", "prompt",
                        f"the prompt exceeds {limits.max_prompt_chars} characters")
    return prompts


def _check_completion(req: CompletionRequest, limits: Limits) -> None:
    prompts = _check_prompt(req.prompt, limits)
    if len(prompts) * req.n > limits.max_choices:
        raise invalid_value("prompt", f"prompts x n is at most {limits.max_choices}")
    _range(req.logprobs, "logprobs", 0, limits.max_top_logprobs)
    if req.suffix is not None:
        raise unsupported_parameter("suffix", "suffix (fill-in-the-middle) is not supported")


# ---- entry points ---------------------------------------------------------------------------

def _validate(model: type[BaseModel], body: Any, limits: Limits):
    if not isinstance(body, dict):
        raise invalid_value(None, "the body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means "not sent"
    # Counts first, so an oversized list is refused before pydantic walks it.
    for name, cap, code in (("messages", limits.max_messages, "too_many_messages"),
                            ("tools", limits.max_tools, "invalid_value")):
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
