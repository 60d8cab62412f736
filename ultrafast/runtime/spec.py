"""Speculative decoding: `propose()` drafts tokens for decoding requests, `verify()` checks them.

The scheduler only sees "k draft tokens scheduled": a decode step feeds the last sampled token
plus the drafts, the target's logits at those k+1 positions go to `verify()` (through the
sampler), and the scheduler keeps the longest prefix of drafts the target agreed with plus the
target's own next token. Rejected drafts' KV is dropped by the executor on the next step.

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
fitted step cost, plus the draft model's own time per draft token). k = 0 (no drafting) when
plain decoding is faster; one draft is then retried after a while.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import torch

from ultrafast.core.types import Draft, ScheduledSeq, StepPlan, TokenLogprobs
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.runtime.sampler import (_mix_seed, draw, logprobs_of, sample_one, target_probs,
                                       token_generator)

SPEC_METHODS = ("off", "ngram", "draft", "auto")
_DRAFT_SEED_SALT = 0x5DEECE66D  # the draft model's draws use other generators than the target's


@dataclass(frozen=True)
class SpecConfig:
    method: str = "auto"  # off, ngram, draft (model), auto (ngram, then the draft model)
    tiers: tuple[ServiceTier, ...] = (ServiceTier.PRIORITY,)  # where n-gram/model drafts run
    max_draft_tokens: int = 5  # upper bound of the adaptive k
    ngram_min: int = 2  # n-gram lookup: the longest suffix of n in [min, max] tokens that
    ngram_max: int = 4  # occurred before decides the draft
    prior_acceptance: float = 0.6  # per-token acceptance assumed for a new request ...
    prior_weight: float = 2.0  # ... worth this many observed draft tokens
    acceptance_decay: float = 0.9  # per verify step: older evidence fades
    retry_after_steps: int = 16  # k == 0: steps without drafts before one draft is retried
    # step time ~ base + per_token * tokens, until the engine's own fit exists (f16 demo model,
    # one thread: 2.3 ms for 1 token, 4.6 ms for 4)
    default_step_base_s: float = 2.0e-3
    default_step_per_token_s: float = 0.5e-3
    use_measured_costs: bool = True  # False: always the defaults above (deterministic tests)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"spec method must be one of {', '.join(SPEC_METHODS)}")
        if self.max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be >= 1")
        if not 0.0 < self.prior_acceptance < 1.0 or not 0.0 < self.acceptance_decay <= 1.0:
            raise ValueError("prior_acceptance must be in (0, 1), acceptance_decay in (0, 1]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")


@dataclass
class SpecStats:
    """Counters since start, per draft source ("ngram", "prediction", "draft")."""

    num_draft_steps: dict[str, int] = field(default_factory=dict)  # decode steps with drafts
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, source: str, num_drafts: int, num_accepted: int) -> None:
        for counter, value in ((self.num_draft_steps, 1), (self.num_draft_tokens, num_drafts),
                               (self.num_accepted_tokens, num_accepted)):
            counter[source] = counter.get(source, 0) + value

    def acceptance_rate(self, source: str | None = None) -> float:
        keys = [source] if source else list(self.num_draft_tokens)
        drafted = sum(self.num_draft_tokens.get(k, 0) for k in keys)
        return sum(self.num_accepted_tokens.get(k, 0) for k in keys) / drafted if drafted else 0.0


# ---- verify ---------------------------------------------------------------------------------


def verify(seq: ScheduledSeq, logits: torch.Tensor) -> tuple[list[int], list[TokenLogprobs]]:
    """Target tokens at the k+1 positions of a decode with k drafts, up to the first rejection.

    `logits` [k+1, vocab] (raw, float32). Returns (tokens, logprobs): the accepted drafts, then
    the correction (at the first rejected position) or the bonus token (all accepted). Position
    j is processed with the penalties of the tokens accepted before it, and its randomness
    comes from (seed, output index), as in plain decoding.
    """
    params = seq.sampling_params
    drafts = seq.token_ids[seq.num_tokens - seq.num_logits + 1:]
    tokens: list[int] = []
    token_logprobs: list[TokenLogprobs] = []
    for j in range(seq.num_logits):
        raw = logits[j]
        history = seq.output_token_ids + drafts[:j] if params.needs_penalties else []
        index = seq.num_output_tokens + j
        if j < len(drafts) and seq.draft_probs is not None and not params.greedy:
            token = _rejection_sample(raw.clone(), seq, history, index, drafts[j],
                                      seq.draft_probs[j])
        else:
            token = sample_one(raw.clone(), seq, history, index)
        tokens.append(token)
        if params.logprobs:
            token_logprobs.append(logprobs_of(raw, token, params.top_logprobs))
        if j < len(drafts) and token != drafts[j]:
            break
    return tokens, token_logprobs


def _rejection_sample(logits: torch.Tensor, seq: ScheduledSeq, history: list[int], index: int,
                      draft_token: int, q: torch.Tensor) -> int:
    """Accept `draft_token` with probability min(1, p/q), else draw from norm(max(p - q, 0))."""
    p = target_probs(logits, seq, history)
    q = q.to(p.dtype)
    generator = token_generator(seq.sampling_seed, index)
    u = float(torch.rand((), generator=generator))
    if u * float(q[draft_token]) < float(p[draft_token]):
        return draft_token
    residual = torch.clamp(p - q, min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is exact
        residual = p
    return draw(residual, generator)


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
        # index every n-gram that ends before the last token (the suffix itself is not a match)
        for end in range(max(self._indexed + 1, self.ngram_min), length):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                ends[tuple(toks[end - n:end])] = end
        self._indexed = max(self._indexed, length - 1)
        for n in range(min(self.ngram_max, length), self.ngram_min - 1, -1):
            end = ends.get(tuple(toks[length - n:]))
            if end is not None:
                draft = toks[end:end + k]
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
                self._ends.setdefault(tuple(prediction[end - n:end]), []).append(end)

    def advance(self, new_tokens: list[int], output: list[int]) -> None:
        pos = self.pos
        if pos is not None and self.prediction[pos:pos + len(new_tokens)] == new_tokens:
            self.pos = pos + len(new_tokens)
            return
        # where a same-length substitution (a renamed identifier) would have left us
        guess = None if pos is None else min(pos + len(new_tokens), len(self.prediction))
        for n in (3, 2):
            ends = self._ends.get(tuple(output[-n:])) if len(output) >= n else None
            if ends:  # anchor on the occurrence nearest the guess (repeated n-grams are common)
                i = bisect.bisect_left(ends, guess or 0)
                near = ends[max(i - 1, 0):i + 1]
                self.pos = min(near, key=lambda end: abs(end - (guess or 0)))
                return
        self.pos = guess  # no anchor: assume the substitution, verification will tell

    def lookup(self, k: int) -> list[int]:
        return [] if self.pos is None else self.prediction[self.pos:self.pos + k]


_GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class _DraftKV:
    """What the draft model's KV of one request holds."""

    slot_id: int
    token_ids: list[int]  # tokens whose KV is in the draft slot, in order
    num_valid: int  # token_ids[:num_valid] is known to equal the request's context


class DraftModelProposer:
    """Drafts with a small model on its own executor (same kind as the target's), one KV slot
    per target slot id. Before drafting, each request's draft KV catches up on the tokens it
    has not seen (the prompt, the target's accepted tokens); rejected drafts are dropped by
    starting the next feed at the first wrong position. All requests draft in one batch.
    Draws greedily (q one-hot) for greedy requests; otherwise from the draft model's own
    processed distribution with the request's sampling params, and hands q to `verify`.
    """

    def __init__(self, executor):
        self.executor = executor
        self.max_batch_tokens = getattr(executor, "max_num_batched_tokens", 512)
        self.per_draft_s = 0.3e-3  # measured: draft-model time per drafted token (EWMA)
        self._kv: dict[str, _DraftKV] = {}
        self._slot_owner: dict[int, str] = {}

    def release(self, request_id: str) -> None:
        self._kv.pop(request_id, None)

    def close(self) -> None:
        self.executor.close()

    def _catch_up_feed(self, request: Request) -> tuple[int, list[int]]:
        """(start position, tokens to feed) so the draft KV holds the whole context."""
        rid, context = request.request_id, request.all_token_ids
        kv = self._kv.get(rid)
        if kv is None or kv.slot_id != request.slot_id or self._slot_owner.get(kv.slot_id) != rid:
            kv = self._kv[rid] = _DraftKV(request.slot_id, [], 0)
            self._slot_owner[request.slot_id] = rid
        valid = min(kv.num_valid, len(context))
        limit = min(len(kv.token_ids), len(context) - 1)  # the last token is always fed
        while valid < limit and kv.token_ids[valid] == context[valid]:
            valid += 1
        valid = min(valid, len(context) - 1)
        del kv.token_ids[valid:]
        kv.num_valid = valid
        return valid, context[valid:]

    def propose(self, wants: list[tuple[Request, int]]) -> dict[str, Draft]:
        start_s = time.perf_counter()
        drafts = self._propose(wants)
        num_tokens = sum(len(d.token_ids) for d in drafts.values())
        if num_tokens:  # a batch shares the passes: the time per token the step pays
            per_token_s = (time.perf_counter() - start_s) / num_tokens
            self.per_draft_s += 0.2 * (per_token_s - self.per_draft_s)
        return drafts

    def _propose(self, wants: list[tuple[Request, int]]) -> dict[str, Draft]:
        wants = [(r, min(k, self.executor.max_model_len - r.num_tokens)) for r, k in wants]
        wants = [(r, k) for r, k in wants if k > 0]
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in wants}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in wants}
        feeds = {r.request_id: self._catch_up_feed(r) for r, _ in wants}
        by_id = {r.request_id: r for r, _ in wants}
        while feeds:  # catch up (chunked to the draft batch); the last chunk yields draft 1
            seqs, budget = [], self.max_batch_tokens
            for rid, (start, feed) in feeds.items():
                n = min(len(feed), budget)
                if n <= 0:
                    break
                seqs.append(self._seq(by_id[rid], feed[:n], start, 1 if n == len(feed) else 0))
                budget -= n
            self._run(seqs, drafts, probs, by_id)
            for seq in seqs:
                start, feed = feeds.pop(seq.request_id)
                if seq.num_tokens < len(feed) and seq.request_id in self._kv:
                    feeds[seq.request_id] = (start + seq.num_tokens, feed[seq.num_tokens:])
        for j in range(1, max((k for _, k in wants), default=0)):  # drafts 2..k, batched
            seqs = [self._seq(r, drafts[r.request_id][-1:], r.num_tokens + j - 1, 1)
                    for r, k in wants if k > j and len(drafts[r.request_id]) == j]
            if not seqs:
                break
            self._run(seqs, drafts, probs, by_id)
        out = {}
        for r, _ in wants:
            tokens, rows = drafts[r.request_id], probs[r.request_id]
            if tokens:
                out[r.request_id] = Draft(tokens, torch.stack(rows) if rows else None, "draft")
        return out

    @staticmethod
    def _seq(request: Request, token_ids: list[int], start: int, num_logits: int) -> ScheduledSeq:
        return ScheduledSeq(request.request_id, request.slot_id, token_ids, start, num_logits,
                            _GREEDY_ONE, 0, 0)

    def _run(self, seqs: list[ScheduledSeq], drafts: dict, probs: dict, by_id: dict) -> None:
        result = self.executor.execute(StepPlan(seqs))
        logits = getattr(self.executor, "last_logits", None)
        row = 0
        for seq in seqs:
            rid = seq.request_id
            if rid in result.errors:  # this request drafts nothing this step
                self._kv.pop(rid, None)
                drafts[rid] = []
                continue
            kv = self._kv[rid]
            kv.token_ids.extend(seq.token_ids)
            if not seq.num_logits:
                continue
            token = result.sampled_token_ids[rid][0]
            request = by_id[rid]
            if not request.sampling_params.greedy and logits is not None:
                token, q = self._sample_draft(request, logits[row], drafts[rid])
                probs[rid].append(q)
            drafts[rid].append(token)
            row += 1

    @staticmethod
    def _sample_draft(request: Request, raw, drafts_so_far: list[int]) -> tuple[int, torch.Tensor]:
        """A draw from the draft model's processed distribution q (returned for verify)."""
        raw = torch.from_numpy(raw.copy()) if not isinstance(raw, torch.Tensor) else raw.float()
        output = request.output_token_ids
        index = request.num_output_tokens + len(drafts_so_far)
        view = ScheduledSeq(request.request_id, request.slot_id or 0, [], 0, 1,
                            request.sampling_params, request.sampling_seed, index,
                            request.prompt_token_ids, output)
        history = output + drafts_so_far if request.sampling_params.needs_penalties else []
        q = target_probs(raw.clone(), view, history)
        generator = torch.Generator().manual_seed(
            _mix_seed(request.sampling_seed ^ _DRAFT_SEED_SALT, index))
        return draw(q, generator), q


# ---- propose ----------------------------------------------------------------------------------


def best_draft_length(acceptance: float, max_draft_tokens: int, base_s: float,
                      per_token_s: float, per_draft_s: float = 0.0) -> int:
    """argmax over k of E[tokens | k drafts] / step time, with per-token acceptance `acceptance`:
    E = 1 + a + ... + a^k, time = base + per_token * (k + 1) + per_draft * k. 0 = don't draft."""
    best_k, best_rate = 0, 1.0 / (base_s + per_token_s)
    expected, power = 1.0, 1.0
    for k in range(1, max_draft_tokens + 1):
        power *= acceptance
        expected += power
        rate = expected / (base_s + per_token_s * (k + 1) + per_draft_s * k)
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

    def __init__(self, config: SpecConfig, draft_model: DraftModelProposer | None = None):
        if config.method == "draft" and draft_model is None:
            raise ValueError("spec method 'draft' needs a draft model")
        self.config = config
        self.draft_model = draft_model if config.method in ("draft", "auto") else None
        self.stats = SpecStats()
        self._states: dict[str, _RequestState] = {}
        self.step_costs = None  # the engine's StepCostModel (base_s, per_token_s), set per step

    def admit(self, request: Request) -> None:
        """Decide once, when a request is added, whether it drafts from n-grams / the model."""
        request.spec_enabled = self.config.method != "off" and request.tier in self.config.tiers

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            cfg = self.config
            sources = ["prediction"] if request.prediction_token_ids else []
            if request.spec_enabled and cfg.method in ("ngram", "auto"):
                sources.append("ngram")
            if request.spec_enabled and self.draft_model is not None:
                sources.append("draft")
            state = _RequestState(request, tuple(sources),
                                  {s: cfg.prior_acceptance * cfg.prior_weight for s in sources},
                                  {s: cfg.prior_weight for s in sources},
                                  {s: 0 for s in sources})
            if "prediction" in sources:
                state.aligner = PredictionAligner(request.prediction_token_ids)
            if "ngram" in sources:
                state.ngram = NgramIndex(request.prompt_token_ids, cfg.ngram_min, cfg.ngram_max)
            self._states[request.request_id] = state
        return state

    def propose(self, running: list[Request]) -> dict[str, Draft]:
        """Drafts for the running requests that will decode next step (at most k each)."""
        out: dict[str, Draft] = {}
        model_wants: list[tuple[Request, int]] = []
        for request in running:
            if not (request.spec_enabled or request.prediction_token_ids):
                continue
            if request.num_tokens - request.num_computed_tokens != 1:
                continue  # still prefilling
            state = self._state(request)
            self._fold_new_output(state)
            room = request.sampling_params.max_tokens - request.num_output_tokens - 1
            for source in state.sources:
                k = min(self._draft_length(state, source), room)
                if k <= 0:
                    continue
                if source == "draft":
                    model_wants.append((request, k))
                    break
                index = state.aligner if source == "prediction" else state.ngram
                tokens = index.lookup(k)
                if tokens:
                    out[request.request_id] = Draft(tokens, None, source)
                    break
        if model_wants:
            out.update(self.draft_model.propose(model_wants))
        return out

    def _draft_length(self, state: _RequestState, source: str) -> int:
        """The k that maximises expected tokens per second; at 0, one draft is retried after
        `retry_after_steps` steps so a request whose text turns predictable gets drafts again."""
        cfg = self.config
        base_s, per_token_s = cfg.default_step_base_s, cfg.default_step_per_token_s
        extra_s = 0.0
        if cfg.use_measured_costs:
            costs = self.step_costs
            if costs is not None and costs.base_s and costs.per_token_s:
                base_s, per_token_s = costs.base_s, costs.per_token_s
            if source == "draft":
                extra_s = self.draft_model.per_draft_s
        k = best_draft_length(state.num_accepted[source] / state.num_tried[source],
                              cfg.max_draft_tokens, base_s, per_token_s, extra_s)
        if k == 0:
            state.idle_steps[source] += 1
            if state.idle_steps[source] >= cfg.retry_after_steps:
                state.idle_steps[source] = 0
                return 1
        return k

    def _fold_new_output(self, state: _RequestState) -> None:
        output = state.request.output_token_ids
        new = output[state.num_seen_output:]
        if not new:
            return
        state.num_seen_output = len(output)
        if state.ngram is not None:
            state.ngram.extend(new)
        if state.aligner is not None:
            state.aligner.advance(new, output)

    def observe(self, plan: StepPlan, finished_ids: list[str]) -> None:
        """Adapt k from the drafts verified in `plan`; forget finished requests."""
        cfg = self.config
        for seq in plan.seqs:
            if seq.num_logits <= 1:
                continue
            state = self._states.get(seq.request_id)
            if state is None:
                continue
            request = state.request
            num_drafts, num_accepted = request.last_num_drafts, request.last_num_accepted
            if not num_drafts:
                continue
            source = request.last_draft_source
            self.stats.add(source, num_drafts, num_accepted)
            if source in state.num_tried:  # tried = accepted + the first rejected, if any
                num_tried = num_accepted + (num_accepted < num_drafts)
                state.num_accepted[source] = (state.num_accepted[source] * cfg.acceptance_decay
                                              + num_accepted)
                state.num_tried[source] = (state.num_tried[source] * cfg.acceptance_decay
                                           + num_tried)
            request.last_num_drafts = 0
        for request_id in finished_ids:
            self.release(request_id)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        if self.draft_model is not None:
            self.draft_model.release(request_id)

    def close(self) -> None:
        if self.draft_model is not None:
            self.draft_model.close()
