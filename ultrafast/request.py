"""Request, SamplingParams and ServiceTier: what the engine is asked to do. Pure Python, no torch.

The engine sees token ids only; text (stop strings, templates) stays in the HTTP layer.
"""

from __future__ import annotations

import enum
import functools
import random
from dataclasses import dataclass, field, fields
from typing import Any

from ultrafast.grammar.spec import GrammarSpec


class ServiceTier(enum.IntEnum):
    """OpenAI's `service_tier`; the int value is the order in which step budget is handed out."""

    PRIORITY = 0  # the Ultrafast lane; `ultrafast` is an alias
    DEFAULT = 1
    FLEX = 2  # yields to everything

    @classmethod
    def parse(cls, name: str | None) -> ServiceTier:
        # OpenAI's `scale` (reserved capacity) and `fast` (its name for priority) are served
        # on the priority lane; `auto` and `scale` may fall back (see server/auth.py)
        aliases = {
            None: cls.DEFAULT,
            "auto": cls.DEFAULT,
            "default": cls.DEFAULT,
            "flex": cls.FLEX,
            "priority": cls.PRIORITY,
            "ultrafast": cls.PRIORITY,
            "fast": cls.PRIORITY,
            "scale": cls.PRIORITY,
        }
        if name not in aliases:
            raise ValueError(f"unknown service tier {name!r}")
        return aliases[name]

    @property
    def api_name(self) -> str:
        return self.name.lower()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its slot; recomputes from its tokens when rescheduled
    FINISHED_STOPPED = "stop"  # eos or stop token id
    FINISHED_LENGTH = "length"  # max_tokens or context limit
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)


@dataclass(frozen=True)
class SamplingChoice:
    """How a call asks to pick each token, before its output budget is known: the server
    makes the call's SamplingParams from it once, when the prompt's length gives max_tokens
    (server/calls.py). Validated here so every entry point gets the same checks."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # None: a random seed is drawn once per request (so resume is exact)
    repetition_penalty: float = 1.0  # HF-style, over prompt + output
    presence_penalty: float = 0.0  # OpenAI-style, over output
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logprobs of the prompt's own tokens (completions `echo` + `logprobs`): None = off, else
    # the number of top alternatives per position. Such a request may have max_tokens 0: it
    # scores the prompt and generates nothing.
    prompt_logprobs: int | None = None
    # Constrained decoding: every sampled token must keep the output inside this grammar
    # (ultrafast/grammar). None = free.
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        checks = [
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs must be in [0, 20]",
            ),
            (0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def with_budget(self, max_tokens: int, **changes: Any) -> SamplingParams:
        """The SamplingParams of this choice with `max_tokens` (and `changes`, e.g. grammar)."""
        values = {f.name: getattr(self, f.name) for f in fields(SamplingChoice)}
        return SamplingParams(**{**values, **changes, "max_tokens": max_tokens})


@dataclass(frozen=True)
class SamplingParams(SamplingChoice):
    """How to pick each next token, and how many at most."""

    max_tokens: int = 16

    def __post_init__(self) -> None:
        scoring = self.prompt_logprobs is not None
        if self.max_tokens < (0 if scoring else 1):
            raise ValueError("max_tokens must be >= 1 (0 only when scoring the prompt)")
        super().__post_init__()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property  # read for every sampled token: computed once per params
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits or asks for them: one batch argmax."""
        return (
            self.greedy
            and not self.logit_bias
            and not self.needs_penalties
            and not self.logprobs
            and self.prompt_logprobs is None
        )

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class Request:
    """One generation. The scheduler moves `num_computed_tokens` towards `num_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    tier: ServiceTier = ServiceTier.DEFAULT
    tenant: str = ""  # salts prefix-cache hashes so tenants never share KV
    arrival_time_s: float = 0.0  # time.monotonic() when the server accepted it
    # its place within its tier (Scheduler): arrival, plus up to the short-first window for
    # the work it is expected to take, so a short request goes ahead of longer ones that
    # arrived less than that much earlier
    order_time_s: float = 0.0
    first_scheduled_time_s: float | None = None  # when it first got a slot (queue wait ends)
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # core.types.TokenLogprobs per token
    num_computed_tokens: int = 0  # tokens whose KV is in the slot
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.cached_tokens)
    num_preemptions: int = 0
    slot_id: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    sampling_seed: int = 0
    # speculative decoding (engine.speculation proposes, the scheduler schedules and counts)
    prediction_token_ids: list[int] = field(default_factory=list)  # client `prediction`
    speculation_enabled: bool = False  # n-gram / draft-model drafts (a prediction is always used)
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_draft_tokens: int = 0
    num_accepted_prediction_tokens: int = 0  # usage.completion_tokens_details
    num_rejected_prediction_tokens: int = 0
    # prompt logprobs (sampling_params.prompt_logprobs): entry i scores prompt token i (entry 0
    # is None: nothing precedes it); handed out once, in the output that completes them
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # constrained decoding: the request's grammar.matcher.GrammarMatcher, made by the engine
    # when it admits a request with sampling_params.grammar (opaque here: no llguidance in core)
    grammar_matcher: Any = None
    # the server's compile of that grammar, still running (a concurrent.futures.Future), or
    # None: until the engine has the matcher nothing is sampled; the prompt prefills and its
    # last row's logits are kept for the matcher (or, on an executor that cannot keep them,
    # the last prompt token waits; Scheduler._schedule_chunk)
    grammar_pending: Any = None

    @property
    def awaits_grammar(self) -> bool:
        """Constrained, and its matcher is not made yet: nothing may be sampled."""
        return self.grammar_matcher is None and self.sampling_params.grammar is not None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        seed = self.sampling_params.seed
        self.sampling_seed = seed if seed is not None else random.getrandbits(63)

    @property
    def held_slot_id(self) -> int:
        """The KV slot of a request the scheduler has placed (running or planned)."""
        if self.slot_id is None:
            raise RuntimeError(f"request {self.request_id} holds no KV slot")
        return self.slot_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
