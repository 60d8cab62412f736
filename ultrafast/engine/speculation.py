"""Speculative decoding, the propose side: drafts for decoding requests, k adapted per request.

The scheduler only sees "k draft tokens scheduled": a decode step feeds the last sampled token
plus the drafts, the target's logits at those k+1 positions go to `sampling.sampler.verify`
(through `sample_plan`), and the scheduler keeps the longest prefix of drafts the target agreed
with plus the target's own next token, and reports what it accepted to `Speculator.observe`.
Rejected drafts' KV is dropped by the executor on the next step.

Draft sources, in the order `auto` tries them per request:
- the client's `prediction` (OpenAI predicted outputs), aligned to the output so far;
- n-gram prompt lookup: the tokens that followed the latest earlier occurrence of the context's
  last n tokens (code repeats itself, so this is nearly free speed);
- a draft model (a second, small executor with the same tokenizer and its own KV per slot).

Exactness. Greedy: a draft is accepted iff it is the target's argmax, so the output is the plain
greedy output token for token. Sampling with a deterministic draft (n-gram, prediction, a
greedy draft model): the target token at each position is drawn exactly as plain decoding draws
it (same processed distribution, same per-index generator) and the draft is accepted iff they
agree; that is rejection sampling with a one-hot q (accept with probability p(x), else a draw
from p without x), and a seeded request gives the very same text as without speculation.
A sampled draft-model draft (q = the draft model's processed distribution) uses standard
rejection sampling: accept x with probability min(1, p(x)/q(x)), else draw from
norm(max(p - q, 0)). Either way the output distribution is the target's.

The number of drafts k adapts per request and per source: the per-token acceptance rate a is
measured (decayed counts of accepted / tried draft tokens), and k is the one that maximises the
expected tokens per step, (1 - a^(k+1)) / (1 - a), over the step's predicted time (the engine's
measured time of a lone step that wide, else its fitted step cost, plus the draft model's own
time per draft token). k = 0 (no drafting) when plain decoding is faster; one draft is then
retried after a while, if that source's drafts could pay at all.

A finished request's n-gram index is kept (a few, per tenant): a conversation's next turn,
whose prompt starts with the previous turn's tokens, takes it over and indexes only its new
tokens.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ultrafast.config import MAX_DRAFT_TOKENS, SPECULATION_METHODS
from ultrafast.core.types import Draft, DraftVerification
from ultrafast.engine.step_costs import StepCostModel
from ultrafast.request import Request, ServiceTier

if TYPE_CHECKING:  # the draft model brings torch; speculation itself does not need it
    from ultrafast.engine.draft_model import DraftModelProposer


@dataclass(frozen=True)
class SpeculationConfig:
    method: str = "auto"  # off, ngram, draft (model), auto (ngram, then the draft model)
    tiers: tuple[ServiceTier, ...] = (ServiceTier.PRIORITY,)  # where n-gram/model drafts run
    max_draft_tokens: int = MAX_DRAFT_TOKENS  # upper bound of the adaptive k
    ngram_min: int = 1  # n-gram lookup: the longest suffix of n in [min, max] tokens that
    ngram_max: int = 4  # occurred before decides the draft
    prior_acceptance: float = 0.6  # per-token acceptance assumed for a new request ...
    prior_weight: float = 2.0  # ... worth this many observed draft tokens
    acceptance_decay: float = 0.9  # per verify step: older evidence fades
    retry_after_steps: int = 16  # k == 0: steps without drafts before one draft is retried
    # step time ~ base + per_token * tokens until the engine's own fit exists: a CPU's demo
    # model order of magnitude, and what deterministic tests size k with
    default_step_base_s: float = 2.0e-3
    default_step_per_token_s: float = 0.5e-3
    use_measured_costs: bool = True  # False: always the defaults above (deterministic tests)

    def __post_init__(self) -> None:
        if self.method not in SPECULATION_METHODS:
            raise ValueError(f"speculation method must be one of {', '.join(SPECULATION_METHODS)}")
        if self.max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be >= 1")
        if not 0.0 < self.prior_acceptance < 1.0 or not 0.0 < self.acceptance_decay <= 1.0:
            raise ValueError("prior_acceptance must be in (0, 1), acceptance_decay in (0, 1]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")


@dataclass
class SpeculationStats:
    """Counters since start, per draft source ("ngram", "prediction", "draft")."""

    num_draft_steps: dict[str, int] = field(default_factory=dict)  # decode steps with drafts
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, source: str, num_drafts: int, num_accepted: int) -> None:
        for counter, value in (
            (self.num_draft_steps, 1),
            (self.num_draft_tokens, num_drafts),
            (self.num_accepted_tokens, num_accepted),
        ):
            counter[source] = counter.get(source, 0) + value

    def acceptance_rate(self, source: str | None = None) -> float:
        keys = [source] if source else list(self.num_draft_tokens)
        drafted = sum(self.num_draft_tokens.get(k, 0) for k in keys)
        return sum(self.num_accepted_tokens.get(k, 0) for k in keys) / drafted if drafted else 0.0


# ---- draft sources --------------------------------------------------------------------------


class NgramIndex:
    """Prompt lookup over a growing token list: n-gram -> end of its latest earlier occurrence.

    Indexing is incremental (a few dict stores per new token), so a lookup costs O(n_max).
    """

    def __init__(self, tokens: list[int], ngram_min: int, ngram_max: int):
        self.tokens = list(tokens)
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending (exclusive) at <= this position are in _ends

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def lookup(self, k: int) -> list[int]:
        toks, length = self.tokens, len(self.tokens)
        ends = self._ends
        # index every n-gram that ends before the last token (the suffix itself is not a match);
        # zip builds the tuples in C: a long conversation's first lookup (2,000 tokens) took
        # 3.2 ms as a Python loop (scripts/ngram_index_time.py), on its second token
        first_end = max(self._indexed + 1, self.ngram_min)
        for n in range(self.ngram_min, self.ngram_max + 1):
            begin = max(first_end, n)  # ends in [begin, length): later ends overwrite earlier
            if begin < length:
                grams = zip(*(toks[begin - n + j : length - n + j] for j in range(n)))
                ends.update(zip(grams, range(begin, length)))
        self._indexed = max(self._indexed, length - 1)
        for n in range(min(self.ngram_max, length), self.ngram_min - 1, -1):
            end = ends.get(tuple(toks[length - n :]))
            if end is not None:
                draft = toks[end : end + k]
                period = length - end
                while len(draft) < k:  # the match runs into the present: a loop, repeat it
                    draft.append(draft[len(draft) - period])
                return draft
        return []


class PredictionAligner:
    """Where the output so far stands in the client's predicted output.

    The pointer advances while the output follows the prediction; after a divergence it
    re-aligns on the occurrence of the output's last n tokens (n from 3 down to 2) nearest to
    where a same-length substitution would be, or else assumes that substitution.
    """

    def __init__(self, prediction: list[int]):
        self.prediction = prediction
        self.pos: int | None = 0  # index in the prediction of the next expected token
        self._ends: dict[tuple[int, ...], list[int]] = {}
        for n in (2, 3):
            for end in range(n, len(prediction) + 1):
                self._ends.setdefault(tuple(prediction[end - n : end]), []).append(end)

    def advance(self, new_tokens: list[int], output: list[int]) -> None:
        pos = self.pos
        if pos is not None and self.prediction[pos : pos + len(new_tokens)] == new_tokens:
            self.pos = pos + len(new_tokens)
            return
        # where a same-length substitution (a renamed identifier) would have left us
        guess = None if pos is None else min(pos + len(new_tokens), len(self.prediction))
        for n in (3, 2):
            ends = self._ends.get(tuple(output[-n:])) if len(output) >= n else None
            if ends:  # anchor on the occurrence nearest the guess (repeated n-grams are common)
                i = bisect.bisect_left(ends, guess or 0)
                near = ends[max(i - 1, 0) : i + 1]
                self.pos = min(near, key=lambda end: abs(end - (guess or 0)))
                return
        self.pos = guess  # no anchor: assume the substitution, verification will tell

    def lookup(self, k: int) -> list[int]:
        return [] if self.pos is None else self.prediction[self.pos : self.pos + k]


# ---- propose ----------------------------------------------------------------------------------


MAX_RETIRED_INDEXES = 8  # finished requests' n-gram indexes kept for a next turn
_RETRY_ACCEPTANCE = 0.99  # what a retried source is assumed to reach at best


def best_draft_length(
    acceptance: float,
    max_draft_tokens: int,
    base_s: float,
    per_token_s: float,
    per_draft_s: float = 0.0,
    measured_pass_s: Sequence[float | None] = (),
) -> int:
    """argmax over k of E[tokens | k drafts] / step time, with per-token acceptance `acceptance`:
    E = 1 + a + ... + a^k, time = pass(k + 1) + per_draft * k. 0 = don't draft.

    pass(n) is `measured_pass_s[n]` where a step of n tokens has been timed, else the line
    base + per_token * n: a size never tried looks as cheap as the line says, gets tried, and
    is then judged by its measured time."""

    def pass_s(num_tokens: int) -> float:
        measured = measured_pass_s[num_tokens] if num_tokens < len(measured_pass_s) else None
        if measured is not None:
            return measured
        return base_s + per_token_s * num_tokens

    best_k, best_rate = 0, 1.0 / pass_s(1)
    expected, power = 1.0, 1.0
    for k in range(1, max_draft_tokens + 1):
        power *= acceptance
        expected += power
        rate = expected / (pass_s(k + 1) + per_draft_s * k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


@dataclass
class _RequestState:
    """Per-request speculation state: an adaptive k per draft source, the lookup indexes."""

    request: Request
    sources: tuple[str, ...]  # tried in order each step; the first with a draft wins
    num_accepted: dict[str, float]  # decayed draft tokens accepted, per source
    num_tried: dict[str, float]  # decayed draft tokens verified up to the first rejection
    idle_steps: dict[str, int]  # decode steps spent at k == 0, per source
    num_seen_output: int = 0  # output tokens already folded into the indexes
    ngram: NgramIndex | None = None
    aligner: PredictionAligner | None = None


class Speculator:
    """propose() before each schedule, observe() after each update. Owned by the engine."""

    def __init__(self, config: SpeculationConfig, draft_model: DraftModelProposer | None = None):
        """draft_model: an engine.draft_model.DraftModelProposer (needed by method draft)."""
        if config.method == "draft" and draft_model is None:
            raise ValueError("speculation method 'draft' needs a draft model")
        self.config = config
        self.draft_model = draft_model if config.method in ("draft", "auto") else None
        self.stats = SpeculationStats()
        self._states: dict[str, _RequestState] = {}
        # n-gram indexes of finished requests, newest last: a conversation's next turn starts
        # with the previous turn's tokens, and takes its index over instead of rebuilding it
        self._retired: collections.deque[tuple[str, NgramIndex]] = collections.deque(
            maxlen=MAX_RETIRED_INDEXES
        )

    def admit(self, request: Request) -> None:
        """Decide once, when a request is added, whether it drafts from n-grams / the model."""
        request.speculation_enabled = (
            self.config.method != "off" and request.tier in self.config.tiers
        )

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            cfg = self.config
            sources = ["prediction"] if request.prediction_token_ids else []
            if request.speculation_enabled and cfg.method in ("ngram", "auto"):
                sources.append("ngram")
            if request.speculation_enabled and self.draft_model is not None:
                sources.append("draft")
            state = _RequestState(
                request,
                tuple(sources),
                {s: cfg.prior_acceptance * cfg.prior_weight for s in sources},
                {s: cfg.prior_weight for s in sources},
                {s: 0 for s in sources},
            )
            if "prediction" in sources:
                state.aligner = PredictionAligner(request.prediction_token_ids)
            if "ngram" in sources:
                state.ngram = self._take_retired_index(request) or NgramIndex(
                    request.prompt_token_ids, cfg.ngram_min, cfg.ngram_max
                )
            self._states[request.request_id] = state
        return state

    def propose(
        self, running: list[Request], step_costs: StepCostModel | None = None
    ) -> dict[str, Draft]:
        """Drafts for the running requests that will decode next step (at most k each);
        `step_costs`, the engine's measured step times, sizes k."""
        out: dict[str, Draft] = {}
        model_wants: list[tuple[Request, int]] = []
        for request in running:
            if not (request.speculation_enabled or request.prediction_token_ids):
                continue
            if request.num_tokens - request.num_computed_tokens != 1:
                continue  # still prefilling
            state = self._state(request)
            self._fold_new_output(state)
            room = request.sampling_params.max_tokens - request.num_output_tokens - 1
            for source in state.sources:
                k = min(self._draft_length(state, source, step_costs), room)
                if k <= 0:
                    continue
                if source == "draft":
                    model_wants.append((request, k))
                    break
                # _state() built the index of every source it listed
                index = state.aligner if source == "prediction" else state.ngram
                tokens = index.lookup(k) if index is not None else []
                if tokens:
                    out[request.request_id] = Draft(tokens, None, source)
                    break
        if model_wants and self.draft_model is not None:  # "draft" is a source only with one
            out.update(self.draft_model.propose(model_wants))
        return out

    def _draft_length(
        self, state: _RequestState, source: str, step_costs: StepCostModel | None
    ) -> int:
        """The k that maximises expected tokens per second; at 0, one draft is retried after
        `retry_after_steps` steps so a request whose text turns predictable gets drafts again."""
        cfg = self.config
        base_s, per_token_s = cfg.default_step_base_s, cfg.default_step_per_token_s
        extra_s = 0.0
        measured: Sequence[float | None] = ()
        # a seeded request sizes k from its own history only: with sampled draft-model drafts
        # the text depends on k, and timings must not change a seeded text
        # a prediction is the client's own draft (OpenAI uses it whenever it is given): it is
        # sized with the default costs, so a noisy measured fit cannot switch it off for good
        if (
            cfg.use_measured_costs
            and state.request.sampling_params.seed is None
            and source != "prediction"
        ):
            if step_costs is not None and step_costs.base_s and step_costs.per_token_s:
                base_s, per_token_s = step_costs.base_s, step_costs.per_token_s
                measured = step_costs.lone_pass_s
            if source == "draft" and self.draft_model is not None:
                extra_s = self.draft_model.per_draft_s
        costs = (cfg.max_draft_tokens, base_s, per_token_s, extra_s, measured)
        k = best_draft_length(state.num_accepted[source] / state.num_tried[source], *costs)
        if k == 0:
            state.idle_steps[source] += 1
            if state.idle_steps[source] >= cfg.retry_after_steps:
                state.idle_steps[source] = 0
                # retry only a source whose drafts could pay if nearly all were accepted: a
                # draft model dearer per token than the target's own step never can (on a
                # small CPU, a draft with its catch-up can cost more than a target step)
                if best_draft_length(_RETRY_ACCEPTANCE, *costs):
                    return 1
        return k

    def _fold_new_output(self, state: _RequestState) -> None:
        output = state.request.output_token_ids
        new = output[state.num_seen_output :]
        if not new:
            return
        state.num_seen_output = len(output)
        if state.ngram is not None:
            state.ngram.extend(new)
        if state.aligner is not None:
            state.aligner.advance(new, output)

    def observe(self, verifications: list[DraftVerification], finished_ids: list[str]) -> None:
        """Adapt k from a step's verified drafts (`Scheduler.update`); forget finished
        requests."""
        cfg = self.config
        for verified in verifications:
            state = self._states.get(verified.request_id)
            if state is None:
                continue
            source, num_drafts = verified.source, verified.num_drafts
            num_accepted = verified.num_accepted
            self.stats.add(source, num_drafts, num_accepted)
            if source in state.num_tried:  # tried = accepted + the first rejected, if any
                num_tried = num_accepted + (num_accepted < num_drafts)
                state.num_accepted[source] = (
                    state.num_accepted[source] * cfg.acceptance_decay + num_accepted
                )
                state.num_tried[source] = state.num_tried[source] * cfg.acceptance_decay + num_tried
        for request_id in finished_ids:
            self.release(request_id)

    def _take_retired_index(self, request: Request) -> NgramIndex | None:
        """The longest retired index of the same tenant whose tokens begin this prompt,
        extended with the rest of it (the index of a 2,000-token history costs ms to build)."""
        prompt, best = request.prompt_token_ids, None
        for entry in self._retired:
            tenant, index = entry
            n = len(index.tokens)
            if (
                tenant == request.tenant
                and n <= len(prompt)
                and prompt[:n] == index.tokens
                and (best is None or n > len(best[1].tokens))
            ):
                best = entry
        if best is None:
            return None
        self._retired.remove(best)
        index = best[1]
        index.extend(prompt[len(index.tokens) :])
        return index

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and state.ngram is not None:
            self._retired.append((state.request.tenant, state.ngram))
        if self.draft_model is not None:
            self.draft_model.release(request_id)

    def close(self) -> None:
        if self.draft_model is not None:
            self.draft_model.close()
