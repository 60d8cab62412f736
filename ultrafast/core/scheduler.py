"""Token-budget continuous batching with service tiers, chunked prefill and preemption.

There are no prefill/decode phases: each request has `num_computed_tokens` and `num_tokens`, and
every step hands out token counts under one budget. A tier is only the order in which the budget
is handed out: priority decodes, default decodes, priority prefill chunks, default prefill
chunks, then flex. A priority request that finds no slot preempts the newest lower-tier request,
which later recomputes (usually from its own cached prefix) and resumes with no token lost.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ultrafast.core.kv_pool import KVSlotPool
from ultrafast.core.step_update import (
    accepted_drafts,
    append_outputs,
    count_drafts,
    scores_prompt,
    step_output,
    take_prompt_logprobs,
)
from ultrafast.core.types import (
    Draft,
    DraftVerification,
    RequestOutput,
    ScheduledSeq,
    StepOutcome,
    StepPlan,
    StepResult,
)
from ultrafast.request import Request, RequestStatus, ServiceTier

# The order a step's budget is handed out in, as (tier, decoding) pairs (an order, not phases:
# a request moves from prefill to decoding by its token counts alone). Requests admitted from a
# tier's queue start right after that tier's running prefills.
_BUDGET_ORDER = (
    (ServiceTier.PRIORITY, True),
    (ServiceTier.DEFAULT, True),
    (ServiceTier.PRIORITY, False),
    (ServiceTier.DEFAULT, False),
    (ServiceTier.FLEX, True),
    (ServiceTier.FLEX, False),
)
_ORDER_RANKS = {place: rank for rank, place in enumerate(_BUDGET_ORDER)}
# prefill tokens a step capped for the default tier's token gaps still carries, so arrivals
# keep moving towards their first token however many decodes share the step
MIN_PREFILL_TOKENS = 32
# decodes a request still has to make (by max_tokens) to be placed among the requests that
# decode in one pass (KVSlotPool.allocate's `lasting`); fewer: placed away from them
LASTING_DECODES = 4


def _order_rank(request: Request) -> int:
    return _ORDER_RANKS[request.tier, request.num_tokens - request.num_computed_tokens == 1]


def _order_key(request: Request) -> tuple[int, float]:
    return _order_rank(request), request.order_time_s


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8  # requests running at once (<= KV slots)
    max_num_batched_tokens: int = 1024  # token budget of one step (EngineConfig's default)
    max_prefill_chunk_tokens: int = 1024  # largest prefill chunk one request gets per step
    max_model_len: int = 2048  # positions per KV slot
    max_waiting: int = 256  # queued requests over all tiers
    max_admissions_per_step: int = 0  # default/flex requests newly started per step; 0 = no cap
    # The executor runs each group of sequences with the same token count as its own forward
    # pass (llama.cpp with a KV stream per slot). A step with priority work then leaves other
    # work of another length to the next step: it would only add passes to the priority
    # request's latency, and costs the same passes a step later.
    one_pass_per_length: bool = False
    # Short requests first: a default/flex request expected to take t seconds is ordered as if
    # it arrived min(t, window) later, so in a burst the requests that finish soon (one-token
    # classifications, short answers) start before long generations that arrived up to
    # `window` earlier, and their slots free sooner. Bounded, so nothing waits for ever.
    # 0 = first come, first served. Priority requests are always first come, first served.
    short_first_window_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_prefill_chunk_tokens) < 1:
            raise ValueError("scheduler limits must be >= 1")


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: KVSlotPool,
        expected_work_s: Callable[[Request], float | None] | None = None,
        keeps_logits: bool = False,
    ):
        """`expected_work_s(request)`: seconds it is expected to run alone (None: unknown);
        with `config.short_first_window_s` it orders each tier's requests, shortest first.
        `keeps_logits`: the executor can keep a row's logits for later sampling
        (executors/base.py KeptSampling), so a request whose grammar still compiles prefills
        its whole prompt (ScheduledSeq.defer_sample) instead of holding the last token back."""
        self.config = config
        self.pool = pool
        self._expected_work_s = expected_work_s
        self._keeps_logits = keeps_logits
        self.waiting: dict[ServiceTier, collections.deque[Request]] = {
            tier: collections.deque() for tier in ServiceTier
        }
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._step_id = 0
        self._finished_outputs: list[RequestOutput] = []  # aborts, reported on the next update
        # Committed capacity: tenant -> running seats kept for its priority requests; another
        # tenant's priority request may not take the last unused ones.
        self._reserved_priority_seats: dict[str, int] = {}
        self._admissions_left = 0
        self._planned_ids: set[str] = set()  # requests with a seq in the plan being built

    # ---- admission -------------------------------------------------------------------------

    @property
    def reserved_priority_seats(self) -> dict[str, int]:
        return dict(self._reserved_priority_seats)

    def set_reserved_priority_seats(self, seats: Mapping[str, int]) -> None:
        """Committed priority seats per tenant. Call it from the engine's own thread (between
        steps), like every other scheduler call."""
        if any(n < 0 for n in seats.values()):
            raise ValueError("reserved seats must be >= 0")
        self._reserved_priority_seats = dict(seats)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def has_work(self) -> bool:
        return bool(self.running or self.num_waiting or self._finished_outputs)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context "
                f"limit is {self.config.max_model_len} including the reply"
            )
        if self.num_waiting >= self.config.max_waiting:
            raise OverflowError("the waiting queue is full")
        request.status = RequestStatus.WAITING
        if not request.arrival_time_s:
            request.arrival_time_s = time.monotonic()
        request.order_time_s = request.arrival_time_s + self._head_start_s(request)
        self.requests[request.request_id] = request
        self.enqueue(request)

    def _head_start_s(self, request: Request) -> float:
        window = self.config.short_first_window_s
        if window <= 0 or request.tier == ServiceTier.PRIORITY or self._expected_work_s is None:
            return 0.0
        work_s = self._expected_work_s(request)
        return 0.0 if work_s is None else min(max(work_s, 0.0), window)

    def enqueue(self, request: Request) -> None:
        """Put a waiting request in its tier's queue at its place (by order_time_s)."""
        queue = self.waiting[request.tier]
        i = len(queue)
        while i > 0 and queue[i - 1].order_time_s > request.order_time_s:
            i -= 1
        queue.insert(i, request)

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._finished_outputs.append(step_output(request, [], []))

    # ---- one step --------------------------------------------------------------------------

    def schedule(
        self,
        drafts: Mapping[str, Draft] | None = None,
        priority_token_budget: int | None = None,
        token_budget: int | None = None,
    ) -> StepPlan:
        """The next step. `drafts`: request id -> draft tokens to verify in its decode this step
        (for running requests; each is cut to fit the budget, the slot and max_tokens).
        `priority_token_budget`: while a priority request is running alongside other work, a
        step holds at most this many tokens (drafts included), so long prefills cannot stretch
        its token gaps; the engine sizes it from measured step costs. `token_budget`: the
        same for the default tier's decodes when no priority request runs (a looser target):
        every running decode still gets its token, and prefill at least MIN_PREFILL_TOKENS."""
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id)
        self._planned_ids = set()
        drafts = drafts or {}
        waiting = self.waiting
        if waiting[ServiceTier.PRIORITY] or waiting[ServiceTier.DEFAULT]:
            self._make_room_for_waiting()
        budget = self.config.max_num_batched_tokens
        # A priority request still to prefill (waiting, or part way) lifts both caps: its time
        # to first token is at stake, and its prefill chunk comes after the default decodes in
        # the budget order, so a capped step would leave it nothing, step after step.
        if not self._priority_prefill_pending():
            if token_budget is not None:
                num_decoding = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
                budget = min(budget, max(token_budget, num_decoding + MIN_PREFILL_TOKENS))
            if priority_token_budget is not None:
                num_priority = sum(r.tier == ServiceTier.PRIORITY for r in self.running)
                if num_priority and self._priority_has_company():  # drafts count against it
                    budget = max(min(budget, priority_token_budget), num_priority)
        self._admissions_left = self.config.max_admissions_per_step or 1 << 30
        # one walk over the running requests in budget order (_BUDGET_ORDER), each place by
        # arrival
        running = self.running
        if len(running) > 1:
            running = sorted(running, key=_order_key)
        i, n = 0, len(running)
        for rank, (tier, decoding) in enumerate(_BUDGET_ORDER):
            while i < n and _order_rank(running[i]) == rank:
                if budget > 0:
                    request = running[i]
                    budget -= self._schedule_chunk(
                        plan, request, budget, drafts.get(request.request_id)
                    )
                i += 1
            if not decoding and waiting[tier]:
                budget = self._admit(plan, tier, budget)
        if self.config.one_pass_per_length:
            self._keep_priority_lengths(plan)
        return plan

    def _keep_priority_lengths(self, plan: StepPlan) -> None:
        """Drop the non-priority sequences whose token count no priority sequence shares.

        Nothing of theirs has changed yet (tokens are committed in update), so they simply run
        next step; a prefix copy already planned for an admitted request still applies."""
        tiers = {r.request_id: r.tier for r in self.running}
        lengths = {s.num_tokens for s in plan.seqs if tiers[s.request_id] == ServiceTier.PRIORITY}
        if lengths:
            plan.seqs = [
                s
                for s in plan.seqs
                if s.num_tokens in lengths or tiers[s.request_id] == ServiceTier.PRIORITY
            ]

    def _priority_prefill_pending(self) -> bool:
        """A priority prefill this step could carry: one running part way, or one waiting
        that may start (one held back by committed seats would lift the caps for nothing)."""
        return self._num_priority_wanting() > 0 or any(
            r.tier == ServiceTier.PRIORITY and r.num_tokens - r.num_computed_tokens > 1
            for r in self.running
        )

    def _priority_has_company(self) -> bool:
        """Is there work besides priority decodes? Only then does the priority step cap
        protect anything; priority streams alone may use the whole budget for their drafts."""
        return bool(self.num_waiting) or any(
            r.tier != ServiceTier.PRIORITY or r.num_tokens - r.num_computed_tokens != 1
            for r in self.running
        )

    def _make_room_for_waiting(self) -> None:
        """Preempt lower tiers before anything is scheduled, so their slots are free to take."""
        num_wanting = 0
        for tier in (ServiceTier.PRIORITY, ServiceTier.DEFAULT):
            num_wanting += (
                self._num_priority_wanting()
                if tier == ServiceTier.PRIORITY
                else len(self.waiting[tier])
            )
            while self._free_capacity() < num_wanting and self._preempt_for(tier):
                pass

    def _free_capacity(self) -> int:
        return min(self.config.max_num_seqs - len(self.running), self.pool.num_available)

    def _admit(self, plan: StepPlan, tier: ServiceTier, budget: int) -> int:
        queue = self.waiting[tier]
        while queue and budget > 0:
            if tier != ServiceTier.PRIORITY and self._admissions_left <= 0:
                break  # the shaper releases default/flex arrivals at a steady rate
            request = self._next_admissible(queue, tier)
            if request is None:
                break
            if len(self.running) >= self.config.max_num_seqs and not self._preempt_for(tier):
                break
            allocation = self._allocate(request)
            if allocation is None and self._preempt_for(tier):
                allocation = self._allocate(request)
            if allocation is None:
                break
            queue.remove(request)
            request.slot_id = allocation.slot_id
            request.num_computed_tokens = allocation.num_cached_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = allocation.num_cached_tokens
            if allocation.copy is not None:
                plan.kv_copies.append(allocation.copy)
            if tier != ServiceTier.PRIORITY:
                self._admissions_left -= 1
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time_s is None:
                request.first_scheduled_time_s = time.monotonic()
            self.running.append(request)
            budget -= self._schedule_chunk(plan, request, budget, None)  # no draft: it waited
        return budget

    def _next_admissible(
        self, queue: collections.deque[Request], tier: ServiceTier
    ) -> Request | None:
        """The first waiting request that may start: priority requests of a tenant past its own
        committed seats leave the other tenants' unused committed seats free."""
        if tier != ServiceTier.PRIORITY or not self._reserved_priority_seats:
            return queue[0]
        running = self._priority_running_by_tenant()
        return next((r for r in queue if self._may_take_priority_seat(r.tenant, running)), None)

    def _priority_running_by_tenant(self) -> dict[str, int]:
        running: dict[str, int] = {}
        for r in self.running:
            if r.tier == ServiceTier.PRIORITY:
                running[r.tenant] = running.get(r.tenant, 0) + 1
        return running

    def _may_take_priority_seat(self, tenant: str, running: dict[str, int]) -> bool:
        reserved = self._reserved_priority_seats
        if running.get(tenant, 0) < reserved.get(tenant, 0):
            return True
        unused_others = sum(
            max(0, n - running.get(t, 0)) for t, n in reserved.items() if t != tenant
        )
        return sum(running.values()) + unused_others < self.config.max_num_seqs

    def _num_priority_wanting(self) -> int:
        """Waiting priority requests that could start, so blocked ones preempt nothing."""
        queue = self.waiting[ServiceTier.PRIORITY]
        if not self._reserved_priority_seats:
            return len(queue)
        running, num = self._priority_running_by_tenant(), 0
        for request in queue:
            if self._may_take_priority_seat(request.tenant, running):
                running[request.tenant] = running.get(request.tenant, 0) + 1
                num += 1
        return num

    def _allocate(self, request: Request):
        decodes_left = request.sampling_params.max_tokens - request.num_output_tokens - 1
        return self.pool.allocate(
            request.request_id,
            request.all_token_ids,
            request.tenant,
            reuse_prefix=not scores_prompt(request),
            lasting=decodes_left >= LASTING_DECODES,
        )

    def _preempt_for(self, tier: ServiceTier) -> bool:
        """Free a slot for `tier` by preempting the newest running request of a lower tier."""
        victims = [r for r in self.running if r.tier > tier and not self._in_plan(r)]
        if not victims:
            return False
        victim = max(victims, key=lambda r: (r.tier, r.arrival_time_s))
        self.running.remove(victim)
        self.pool.release(victim.held_slot_id)  # its KV stays cached; it may get it straight back
        victim.slot_id = None
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self.waiting[victim.tier].appendleft(victim)
        self.num_preemptions += 1
        return True

    def _in_plan(self, request: Request) -> bool:
        return request.request_id in self._planned_ids

    def _schedule_chunk(
        self, plan: StepPlan, request: Request, budget: int, draft: Draft | None
    ) -> int:
        start = request.num_computed_tokens
        awaits = request.awaits_grammar  # its first logits wait for the grammar
        end = request.num_tokens - (awaits and not self._keeps_logits)
        n = min(end - start, budget, self.config.max_prefill_chunk_tokens)
        if n <= 0:
            return 0
        self._planned_ids.add(request.request_id)
        token_ids = request.token_slice(start, start + n)
        num_drafts, draft_probs = 0, None
        if draft is not None and start + n == request.num_tokens:  # a decode: drafts may ride
            # the drafts share the budget, fit the slot, and never reach past max_tokens
            num_drafts = max(
                0,
                min(
                    len(draft.token_ids),
                    budget - n,
                    self.config.max_model_len - request.num_tokens - 1,
                    request.sampling_params.max_tokens - request.num_output_tokens - 1,
                ),
            )
            if num_drafts:
                token_ids = token_ids + draft.token_ids[:num_drafts]
                if draft.probs is not None:
                    draft_probs = draft.probs[:num_drafts]
                plan.draft_sources[request.request_id] = draft.source
        samples = start + n == request.num_tokens and request.sampling_params.max_tokens > 0
        plan.seqs.append(
            ScheduledSeq(
                request_id=request.request_id,
                slot_id=request.held_slot_id,
                token_ids=token_ids,
                start_position=start,
                num_logits=1 + num_drafts if samples else 0,
                defer_sample=samples and awaits,
                sampling_params=request.sampling_params,
                sampling_seed=request.sampling_seed,
                num_output_tokens=request.num_output_tokens,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                draft_probs=draft_probs,
                # rows whose next token is a prompt token score it
                num_prompt_logits=max(0, min(n, request.num_prompt_tokens - 1 - start))
                if scores_prompt(request)
                else 0,
            )
        )
        return n + num_drafts

    def update(self, plan: StepPlan, result: StepResult) -> StepOutcome:
        outputs, self._finished_outputs = self._finished_outputs, []
        verifications: list[DraftVerification] = []
        for seq in plan.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            error = result.errors.get(seq.request_id)
            if error is None and seq.num_prompt_logits:
                error = take_prompt_logprobs(request, seq, result)
            if error is not None:
                self._finish(request, RequestStatus.FINISHED_ERROR)
                out = step_output(request, [], [])
                out.error = error
                outputs.append(out)
                continue
            if not seq.num_logits or seq.defer_sample:  # kept logits: the engine samples them
                request.num_computed_tokens += seq.num_tokens
                self._commit(request)
                if request.num_computed_tokens == request.num_tokens and not seq.defer_sample:
                    self._finish(request, RequestStatus.FINISHED_LENGTH)  # max_tokens 0: scored
                    outputs.append(step_output(request, [], []))
                continue
            sampled = result.sampled_token_ids[seq.request_id]
            num_drafts = seq.num_logits - 1
            num_accepted = accepted_drafts(seq, sampled)
            # KV of the rejected drafts is dropped by the executor on the next step
            request.num_computed_tokens += seq.num_tokens - num_drafts + num_accepted
            logprobs = result.logprobs.get(seq.request_id) if result.logprobs else None
            new_ids, new_logprobs, status = append_outputs(
                request,
                self.config.max_model_len,
                sampled[: num_accepted + 1],
                logprobs[: num_accepted + 1] if logprobs else [],
            )
            if num_drafts:
                verifications.append(
                    count_drafts(
                        request,
                        plan.draft_sources.get(seq.request_id, ""),
                        num_drafts,
                        min(num_accepted, len(new_ids)),
                    )
                )
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            self._commit(request)
            if status is not None:
                self._finish(request, status)
            outputs.append(step_output(request, new_ids, new_logprobs))
        return StepOutcome(outputs, verifications)

    def _commit(self, request: Request) -> None:
        """The slot's KV now holds the request's computed tokens (its prefix cache entry)."""
        pool_args = (request.all_token_ids, request.num_computed_tokens, request.tenant)
        self.pool.commit(request.held_slot_id, *pool_args)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            queue = self.waiting[request.tier]
            if request in queue:
                queue.remove(request)
        if request.slot_id is not None:
            self.pool.release(request.slot_id)
            request.slot_id = None
        self.requests.pop(request.request_id, None)
