"""The scheduler/executor contract: StepPlan (what to run) and StepResult (what came out).

Plain dataclasses of ints and lists, so the scheduler can be tested with a fake executor and the
executor can later live in another process without touching the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ultrafast.request import SamplingParams


@dataclass
class KVCopy:
    """Copy the first `num_tokens` positions of one slot's KV into another (a prefix-cache hit)."""

    src_slot_id: int  # slot holding the cached prefix
    dst_slot_id: int  # slot of the request that reuses it
    num_tokens: int  # positions [0, num_tokens) are copied; dst beyond that is dropped


@dataclass
class ScheduledSeq:
    """One request's share of a step.

    The executor first drops any KV of `slot_id` at positions >= `start_position` (stale tokens
    of an earlier owner, rejected drafts), then writes the KV of `token_ids` at
    `start_position ...`, and samples at the last `num_logits` of those positions.
    A decode with k draft tokens has token_ids = [last sampled token] + drafts and
    num_logits = k + 1; the sampler verifies the drafts (sampling.sampler.verify).
    """

    request_id: str
    slot_id: int  # KV slot (== llama.cpp sequence id) owned by this request
    token_ids: list[int]  # tokens fed this step: a prefill chunk, the last sampled token, + drafts
    start_position: int  # position of token_ids[0]; equals request.num_computed_tokens
    num_logits: int  # 0 for a prefill chunk that does not reach the end of the known tokens
    sampling_params: SamplingParams
    sampling_seed: int  # per request; the token at output index i is drawn from (seed, i)
    num_output_tokens: int  # output tokens generated before this step
    prompt_token_ids: list[int] = field(default_factory=list)  # for repetition penalty (by ref)
    output_token_ids: list[int] = field(default_factory=list)  # for presence/frequency (by ref)
    # [k, vocab] probabilities the draft model drew the drafts from; None = deterministic drafts
    # (n-gram, prediction, greedy draft model). Opaque here: core never touches tensors.
    draft_probs: Any = None
    # Prompt scoring: the first `num_prompt_logits` rows also return logits, and row j gives the
    # logprob of the prompt token at start_position + j + 1 (StepResult.prompt_logprobs).
    # Those rows come before the `num_logits` sampled rows; the two never overlap.
    num_prompt_logits: int = 0
    # Constrained decoding: int32 [num_logits, ceil(vocab / 32)] packed bits (numpy), row j
    # allows the tokens that may follow the drafts before position j; None = free.
    # The sampler masks the logits with it before anything else (ultrafast/grammar/mask.py).
    token_mask: Any = None
    # The last prompt token of a request whose grammar still compiles: the executor keeps
    # that row's logits instead of sampling (StepResult.kept_logits; num_logits is 1), and
    # the engine samples them under the mask once the matcher exists (`sample_kept`)
    defer_sample: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Draft:
    """Draft tokens for a request's next decode step (engine.speculation.Speculator.propose)."""

    token_ids: list[int]
    probs: Any = None  # [k, vocab] draft-model probabilities, None for deterministic drafts
    source: str = ""  # "ngram", "prediction", "draft" (the model) or "grammar" (forced)


@dataclass
class StepPlan:
    """Everything the executor runs in one forward pass."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    kv_copies: list[KVCopy] = field(default_factory=list)  # applied before the forward pass
    step_id: int = 0
    # request id -> Draft.source of the drafts its seq carries (the executor ignores it;
    # the scheduler reports acceptance per source from it)
    draft_sources: dict[str, str] = field(default_factory=dict)
    # kernel threads to leave idle in this step: a grammar compiles on another thread, and a
    # core of its own lets it finish (and its request start) instead of timesharing with the
    # pass's spinning threads (executors that size no thread pool ignore it)
    spare_threads: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.kv_copies


@dataclass
class TokenLogprobs:
    """Logprob of a sampled token under the model's raw distribution, plus the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class StepResult:
    """What came out of a step, keyed by request id."""

    # entry j = the target's token at the j-th sampled position given the drafts before it;
    # with drafts, verification may stop after the first entry that differs from its draft
    # (1 <= len <= num_logits), the scheduler keeps the matching prefix plus that one token
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # only if asked
    # one entry per prompt-scoring row (ScheduledSeq.num_prompt_logits), in row order
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # a request that failed alone
    # request id -> a defer_sample seq's logits as the executor keeps them (opaque outside
    # it: only its `sample_kept` reads them)
    kept_logits: dict[str, Any] = field(default_factory=dict)
    execute_time_s: float = 0.0  # forward pass
    sample_time_s: float = 0.0  # sampling on the logits
    # forward passes the step ran as, where the executor knows (None: ExecutorCaps'
    # one_pass_per_length tells); a one-pass step teaches the step-cost line
    num_passes: int | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request (the engine forwards it to the caller)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    queue_time_s: float = 0.0  # arrival to first slot
    num_accepted_prediction_tokens: int = 0  # so far, of drafts taken from the client prediction
    num_rejected_prediction_tokens: int = 0
    # once per request, when asked for (SamplingParams.prompt_logprobs): one entry per prompt
    # token, the first None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class DraftVerification:
    """How one request's drafts fared in one step (the speculator adapts k from it)."""

    request_id: str
    source: str  # Draft.source
    num_drafts: int  # drafts scheduled (>= 1)
    num_accepted: int  # of those, kept as output (a stop inside the drafts cuts the rest)


@dataclass
class StepOutcome:
    """What `Scheduler.update` made of a step: per-request outputs and draft acceptance."""

    outputs: list[RequestOutput] = field(default_factory=list)
    verifications: list[DraftVerification] = field(default_factory=list)
