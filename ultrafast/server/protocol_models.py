"""Shape and type of the OpenAI request fields we support (pydantic v2, strict, no extras).

Ranges and limits are checked in `protocol.py`, which is the module callers import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
)

from ultrafast.request import SamplingChoice, SamplingParams, ServiceTier
from ultrafast.server.errors import from_validation_error, invalid_value

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # always fullmatch: `$` would accept a final \n
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # canonical, so "1" and "01" cannot both appear
OPTIONAL_FEATURES = frozenset({"tools", "response_format", "session_id"})
# Media parts are refused by name (B39): this server never fetches a URL or reads a file.
MEDIA_PART_TYPES = frozenset(
    {
        "image_url",
        "input_image",
        "image",
        "input_audio",
        "audio_url",
        "video_url",
        "file",
        "input_file",
    }
)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MAX_MODEL_NAME_CHARS = 256  # the name is echoed in a 404; keep that small
MAX_SAFETY_IDENTIFIER_CHARS = 128  # OpenAI's documented limit
MAX_PROMPT_CACHE_KEY_CHARS = 1024
# OpenAI's hint values (openai-python's types); a model without reasoning ignores them
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
VERBOSITIES = ("low", "medium", "high")
PROMPT_CACHE_RETENTIONS = ("in_memory", "in-memory", "24h")
# `auto` and `scale` take the best tier the key may use now (scale: OpenAI's reserved capacity)
AUTO_TIER_NAMES = ("auto", "scale")


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
    # the model's own sampling defaults (generation_config.json / GGUF general.sampling.*),
    # used for each of temperature, top_p, top_k, min_p, repetition_penalty a request leaves out
    sampling_defaults: tuple[tuple[str, float], ...] = ()


# ---- models ---------------------------------------------------------------------------------


def _json_type(value: Any) -> str:
    """Union members are picked by JSON type, so a failure is reported once, for the member
    the client meant, instead of once per member."""
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else "?"


_UNION_TAGS = frozenset({"string", "array", "object"})
_MESSAGE_SHAPE = re.compile(r"messages\[\d+\]\.(role|content)(\[\d+\].*)?")


# A union picked by JSON type: `Annotated[Annotated[A, JSON_STRING] | Annotated[B, JSON_ARRAY],
# BY_JSON_TYPE]`; each member is tagged with the name `_json_type` gives a value of its type.
JSON_STRING, JSON_ARRAY, JSON_OBJECT = Tag("string"), Tag("array"), Tag("object")
BY_JSON_TYPE = Discriminator(_json_type)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# the Responses API's input items are told apart by `type` (tools/responses_api.py item_type)
ITEM_TAGS = frozenset({"message", "function_call", "function_call_output"})
MAX_ITEMS_PER_CALL = 1024


def validate_input(model: type[BaseModel], body: object):
    """A Responses, Conversations or Realtime body (or item) as `model`: a 400 names the exact
    item path (`input[2].content[0].text`); `items`/`input` hold at most MAX_ITEMS_PER_CALL."""
    if not isinstance(body, dict):
        raise invalid_value(None, "the body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    for name in ("items", "input"):
        if isinstance(body.get(name), list) and len(body[name]) > MAX_ITEMS_PER_CALL:
            raise invalid_value(name, f"{name} has at most {MAX_ITEMS_PER_CALL} entries")
    try:
        return model.model_validate(body)
    except ValidationError as exc:  # union members are tagged by JSON type: exact item paths
        raise from_validation_error(exc, body, _UNION_TAGS | ITEM_TAGS) from None


def _integral_float_to_int(value: Any) -> Any:
    """JSON has one number type: OpenAI's API takes `2.0` where an integer is expected."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# An integer field: an int, or a float with no fractional part (`2.5` and `true` are refused)
Int = Annotated[int, BeforeValidator(_integral_float_to_int)]


class ContentPart(BaseModel):
    # Extra keys pass pydantic only so media parts reach the check that names them (B39).
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


Content = Annotated[
    Annotated[str, JSON_STRING] | Annotated[list[ContentPart], JSON_ARRAY], BY_JSON_TYPE
]


class FunctionCall(StrictModel):
    name: str
    arguments: str


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


class StreamOptions(StrictModel):
    include_usage: bool = False
    # OpenAI pads stream events with random characters against length side channels; this
    # server adds no padding, so the flag is accepted and has nothing to turn off
    include_obfuscation: bool | None = None
    # ultrafast's agent fast path (server/tools/stream.py): an `event: tool_call.done` SSE
    # event the moment each tool call is complete. Opt-in: the official client would parse an
    # unrequested named event as a malformed chunk.
    include_tool_call_done: bool = False


class Prediction(StrictModel):
    type: Literal["content"]
    content: Content


class FunctionDef(StrictModel):
    name: str
    description: str | None = None
    parameters: Any = None  # a JSON Schema, checked by jsonschema (B35)
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceName(StrictModel):
    name: str


class ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    function: ToolChoiceName


class JsonSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: Any = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(StrictModel):
    """Fields both endpoints share, and what they turn into for the engine."""

    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None  # 0 means greedy (only the most likely token is left)
    top_k: Int | None = None
    min_p: float | None = None
    n: Int = 1
    stop: (
        Annotated[Annotated[str, JSON_STRING] | Annotated[list[str], JSON_ARRAY], BY_JSON_TYPE]
        | None
    ) = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    keep_alive: Any = None  # Ollama's extension: how long the model stays loaded (residency/)
    repetition_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None  # values checked by hand: one param for all
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    service_tier: Any = None  # checked by hand: 1e9 is invalid_value, not invalid_type (B42)
    priority: Any = None  # accepted alias of service_tier
    ignore_eos: bool = False
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # OpenAI's hints, accepted and validated; none changes the output. `prompt_cache_key`
    # stays on the request as a routing hint: one server's prefix cache already matches
    # prompts by content (per tenant), so here it changes nothing; a router in front of
    # several servers may send the calls that share a key to the same one.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None

    def requested_tier_name(self) -> str | None:
        return self.service_tier if self.service_tier is not None else self.priority

    def tier(self) -> ServiceTier:
        return ServiceTier.parse(self.requested_tier_name())

    def tier_is_auto(self) -> bool:
        """May the served tier fall back (auth, admission) from the one the name maps to?"""
        return self.requested_tier_name() in AUTO_TIER_NAMES

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> tuple[bool, int]:
        return False, 0

    def _prompt_logprobs(self, max_tokens: int | None) -> int | None:
        return None

    def sampling_params(
        self,
        vocab_size: int,
        default_max_tokens: int,
        model_defaults: tuple[tuple[str, float], ...] = (),
    ) -> SamplingParams:
        """`default_max_tokens` is used when the client sent no limit; the server picks it
        (min of the per-key cap and the context left after the prompt). `model_defaults`
        (Limits.sampling_defaults) fill the sampling fields the client left out."""
        requested = self.requested_max_tokens()
        max_tokens = default_max_tokens if requested is None else requested
        choice = self.sampling_choice(vocab_size, model_defaults)
        return choice.with_budget(max_tokens, prompt_logprobs=self._prompt_logprobs(max_tokens))

    def sampling_choice(
        self, vocab_size: int, model_defaults: tuple[tuple[str, float], ...] = ()
    ) -> SamplingChoice:
        """The sampling fields without the output budget (the server adds it once it knows
        the prompt's length: server/calls.py); `model_defaults` fill the fields left out."""
        model = dict(model_defaults)
        top_k = self.top_k if self.top_k is not None else int(model.get("top_k", 0))
        top_k = top_k if 0 < top_k < vocab_size else 0
        logprobs, top_logprobs = self._logprobs()
        bias = sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
        temperature = (
            model.get("temperature", 1.0) if self.temperature is None else self.temperature
        )
        top_p = model.get("top_p", 1.0) if self.top_p is None else self.top_p
        if top_p == 0.0:  # a nucleus of probability 0 holds just the most likely token
            temperature, top_p = 0.0, 1.0
        return SamplingChoice(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=model.get("min_p", 0.0) if self.min_p is None else self.min_p,
            seed=self.seed,
            repetition_penalty=model.get("repetition_penalty", 1.0)
            if self.repetition_penalty is None
            else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=tuple((k, v) for k, v in bias if k < vocab_size),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            ignore_eos=self.ignore_eos,
            prompt_logprobs=self._prompt_logprobs(self.requested_max_tokens()),
        )


class ChatCompletionRequest(_Common):
    messages: list[Message]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    prediction: Prediction | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: (
        Annotated[
            Annotated[Literal["none", "auto", "required"], JSON_STRING]
            | Annotated[ToolChoiceFunction, JSON_OBJECT],
            BY_JSON_TYPE,
        ]
        | None
    ) = None
    parallel_tool_calls: bool | None = None
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


COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class CompletionRequest(_Common):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by hand (B24)
    logprobs: Int | None = None  # number of top alternatives, 0..20
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None  # only 1: each choice is returned as sampled

    def requested_max_tokens(self) -> int | None:
        # the spec's default, and vLLM's: a raw prompt without max_tokens continues for 16
        # tokens (chat, which has a stop of its own, runs to the end of the turn instead)
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def _logprobs(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def _prompt_logprobs(self, max_tokens: int | None) -> int | None:
        """`echo` with `logprobs` scores the prompt too; `max_tokens` 0 scores it only."""
        if self.echo and (self.logprobs is not None or max_tokens == 0):
            return self.logprobs or 0
        return None

    def prompt_list(self) -> list:
        """One entry per prompt: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)
