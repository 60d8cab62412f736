"""The synchronous step loop: propose drafts -> schedule -> execute -> update -> observe.

The engine sees token ids only. `EngineCore` owns the scheduler, the KV slot pool, the step
cost model and the speculator; `engine.thread.EngineThread` runs it for the server.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

from ultrafast.core.kv_pool import KVSlotPool
from ultrafast.core.scheduler import Scheduler, SchedulerConfig
from ultrafast.core.types import (
    Draft,
    RequestOutput,
    ScheduledSeq,
    StepOutcome,
    StepPlan,
    StepResult,
)
from ultrafast.engine import grammar_steps
from ultrafast.engine.idle_speed import IdleSpeed
from ultrafast.engine.speculation import SpecStats, Speculator, best_draft_length
from ultrafast.engine.start_costs import StartCosts
from ultrafast.engine.step_costs import StepCostModel
from ultrafast.executors.base import Executor, KeptSampling
from ultrafast.kvcache.manager import KVCacheConfig, KVCacheManager
from ultrafast.request import Request, SamplingParams, ServiceTier

log = logging.getLogger(__name__)

COMPILE_POLL_S = 0.002  # an idle step's wait for a compile: new arrivals wait at most this
# kernel threads a step leaves idle while a grammar compiles on any thread (_a_grammar_compiles):
# with every core in the pass, the compile timeshares with spinning kernel threads and the
# request's first token waits for both (bench grammar: first-seen schema TTFT)
COMPILE_SPARE_THREADS = 1
# and each such step is sized to about this long at the full thread count (~twice that on
# one core fewer), so a compile of a few ms is noticed soon after it ends. Only where a lone
# decode is shorter than this: a model whose steps outlast a compile (SmolLM2: ~10 ms a
# decode, ~6 ms a 10 KB schema) hides the compile in its prefill, and a step on one core
# fewer would cost more than the compile it speeds up (+22 ms first-seen TTFT when tried)
COMPILE_STEP_S = 0.002
FORCED_DRAFT_RETRY_STEPS = 64  # steps without forced drafts before one is tried again
# calls that reuse "no forced draft pays" before it is recomputed from the step costs: the
# search is a Python loop over draft lengths, run for every constrained seq
FORCED_WORTH_REUSE_CALLS = 16


@dataclass
class StepStats:
    """One step's numbers, for metrics (only server/metrics.py turns them into Prometheus)."""

    step_id: int
    num_seqs: int
    num_tokens: int
    num_running: int
    num_waiting: int
    schedule_time_s: float
    execute_time_s: float
    sample_time_s: float
    update_time_s: float
    propose_time_s: float = 0.0  # speculative drafting before the step (draft model, lookups)
    num_draft_tokens: int = 0  # drafts scheduled in this step


@dataclass
class EngineOccupancy:
    """Queues, slots and cache counts, for metrics. `EngineCore.occupancy()` only counts, so
    the metrics scrape may call it from the event loop: a value may be one step old."""

    num_waiting_by_tier: tuple[int, ...]  # indexed by ServiceTier value
    num_running_by_tier: tuple[int, ...]
    num_kv_slots_running: int  # slots owned by a running request
    num_kv_slots_total: int
    num_prefix_queries: int  # cumulative: prefix-cache lookups
    num_prefix_query_tokens: int  # cumulative: prompt tokens looked up
    num_prefix_hit_tokens: int  # cumulative: tokens served from the cache
    num_preemptions: int = 0  # cumulative: running requests preempted for a higher tier


class EngineCore:
    """Synchronous engine: call `step()` until `has_work()` is False."""

    def __init__(
        self,
        executor: Executor,
        config: SchedulerConfig,
        priority_itl_target_s: float | None = None,
        speculator: Speculator | None = None,
        kv_cache: KVCacheConfig | None = None,
        default_itl_target_s: float | None = None,
        grammar: Any = None,
    ):
        """priority_itl_target_s: None = no cap on steps carrying priority work, 0 = auto.
        speculator: None for plain decoding (client predictions are then ignored).
        kv_cache: the tiered KV cache (host memory, disk, Redis) under the slots, if enabled.
        default_itl_target_s: the default tier's token gap; steps that carry its decodes (and
        no priority work) are sized to it. None = no cap.
        grammar: a grammar.matcher.GrammarRuntime for constrained requests (None: refused).
        """
        if config.max_num_seqs > executor.num_slots:
            raise ValueError("max_num_seqs cannot exceed the executor's KV slots")
        if config.max_model_len > executor.max_model_len:
            raise ValueError("max_model_len cannot exceed the executor's slot length")
        self.executor = executor
        config = replace(
            config,
            one_pass_per_length=config.one_pass_per_length
            or getattr(executor, "one_pass_per_length", False),
        )
        self.pool = KVSlotPool(executor.num_slots)
        # held while the pool changes, so another thread may read it (cached_prefix_tokens)
        self.pool_lock = threading.Lock()
        self.scheduler = Scheduler(
            config,
            self.pool,
            self._expected_work_s,
            keeps_logits=bool(getattr(executor, "keeps_logits", False)),
        )
        self.last_stats: StepStats | None = None
        self.priority_itl_target_s = priority_itl_target_s
        self.costs = StepCostModel()
        # tokens a step with priority work may hold (Scheduler.schedule); sized from `costs`
        # after each step that had a priority request running, None = no cap
        self.priority_token_budget: int | None = None
        self.default_itl_target_s = default_itl_target_s
        # the same for steps whose tightest tier is the default one (no priority running)
        self.step_token_budget: int | None = None
        self.speculator = speculator
        self.grammar = grammar
        self._compiling: dict[str, Request] = {}  # admitted while their grammar compiles
        # request id -> the logits its last prompt token left while its grammar compiled
        # (ScheduledSeq.defer_sample), sampled when the matcher is made
        self._kept: dict[str, Any] = {}
        self._forced_idle_steps = 0  # calls of _forced_drafts_worth that proposed none
        # (forced tokens available, lone stream) -> calls left that may reuse "none pay"
        self._forced_none_memo: dict[tuple[int, bool], int] = {}
        self.idle_speed: IdleSpeed | None = None  # timed by warmup(measure_speed=True)
        self.start_costs = StartCosts(self)
        self.kv_cache: KVCacheManager | None = None
        if kv_cache is not None and kv_cache.enabled:
            self.kv_cache = KVCacheManager(kv_cache, executor, self.pool)

    @property
    def spec_stats(self) -> SpecStats | None:
        """Drafted / accepted tokens per draft source; None without speculation."""
        return None if self.speculator is None else self.speculator.stats

    def warmup(
        self, num_prompt_tokens: int = 16, measure_speed: bool = True, background: bool = False
    ) -> None:
        """A short prefill and decode before serving (a fresh executor's first pass allocates
        its compute graph); with `measure_speed`, the start costs (thread plan, idle speed):
        cached, or measured now, or (`background`) pending for the engine's idle time."""
        self.measure_on_idle(lambda: self._warmup(num_prompt_tokens, measure_speed, background))

    def measure_on_idle(self, measure: Callable[[], None]) -> None:
        """Run `measure` (made-up prompts) on the idle engine, the slots' cached prefixes
        dropped first; such prompts are not conversations: the tiered KV cache stays out."""
        kv_cache, self.kv_cache = self.kv_cache, None
        on_evict, self.pool.on_evict = self.pool.on_evict, None
        try:
            with self.pool_lock:
                self.pool.reset_cache()
            measure()
        finally:
            self.kv_cache, self.pool.on_evict = kv_cache, on_evict

    def reset_costs(self) -> None:
        self.costs = StepCostModel()

    def _warmup(self, num_prompt_tokens: int, measure_speed: bool, background: bool) -> None:
        self.start_costs.before_warmup()  # cached costs, else a safe thread count
        prompt = [i % self.executor.vocab_size for i in range(1, num_prompt_tokens + 1)]
        self.add_request(
            Request(
                "warmup",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                tier=ServiceTier.PRIORITY,  # priority: drafting warms too
            )
        )
        while self.has_work():
            self.step()
        with self.pool_lock:
            self.pool.reset_cache()
        self.costs = StepCostModel()  # learn from warm passes, not from the cold first one
        if measure_speed:  # thread plan and idle speed (engine/start_costs.py)
            self.start_costs.at_warmup(background)

    def add_request(self, request: Request) -> None:
        for token in request.prompt_token_ids:
            if not 0 <= token < self.executor.vocab_size:
                raise ValueError(
                    f"token id {token} is out of vocabulary (size {self.executor.vocab_size})"
                )
        spec = request.sampling_params.grammar
        if spec is not None and request.grammar_matcher is None:
            if self.grammar is None:
                raise ValueError("constrained decoding is not available with this model")
            pending = request.grammar_pending
            if pending is not None and not pending.done():
                # still compiling (server thread): the prompt prefills meanwhile, all but the
                # token that gives the first logits (Scheduler); the matcher comes at a step
                self._compiling[request.request_id] = request
            else:
                # a cache hit when the server compiled it first (off this thread); a
                # GrammarError is a ValueError, which fails this request alone
                request.grammar_matcher = self.grammar.matcher(spec, request.eos_token_ids)
        if self.speculator is not None:
            self.speculator.admit(request)
        self.scheduler.add_request(request)
        if self.kv_cache is not None:  # its KV may be on disk or in Redis: read it first
            with self.pool_lock:
                self.kv_cache.hold_for_fetch(request, self.scheduler)

    def abort(self, request_id: str) -> None:
        with self.pool_lock:
            self.scheduler.abort(request_id)

    def cached_prefix_tokens(self, token_ids: list[int], tenant: str) -> int:
        """Leading tokens of `token_ids` some KV slot holds for `tenant` now. Safe from any
        thread: the prompt is hashed here, the slots are compared under the pool lock."""
        wanted = self.pool.prefix_hashes(token_ids, tenant)
        with self.pool_lock:
            in_slots = self.pool.num_cached_prefix_tokens(token_ids, tenant, wanted)
        if self.kv_cache is not None:  # a prefix in host memory is restored before its prefill
            return max(in_slots, self.kv_cache.host_prefix_tokens(wanted))
        return in_slots

    def occupancy(self) -> EngineOccupancy:
        sched, pool = self.scheduler, self.pool
        running = [0, 0, 0]  # ServiceTier values 0..2
        for request in sched.running:
            running[request.tier] += 1
        waiting = sched.waiting
        return EngineOccupancy(
            num_waiting_by_tier=(
                len(waiting[ServiceTier.PRIORITY]),
                len(waiting[ServiceTier.DEFAULT]),
                len(waiting[ServiceTier.FLEX]),
            ),
            num_running_by_tier=tuple(running),
            num_kv_slots_running=pool.num_running,
            num_kv_slots_total=pool.num_slots,
            num_prefix_queries=pool.num_prefix_queries,
            num_prefix_query_tokens=pool.num_prefix_query_tokens,
            num_prefix_hit_tokens=pool.num_prefix_hit_tokens,
            num_preemptions=sched.num_preemptions,
        )

    def close(self) -> None:
        """Finish the tiered KV cache's queued writes, then free the executor."""
        if self.kv_cache is not None:
            self.kv_cache.close()
        self.executor.close()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or (self.kv_cache is not None and self.kv_cache.has_held())

    def _propose(self, speculator: Speculator) -> dict[str, Draft]:
        try:  # k is sized by the measured step cost
            return speculator.propose(self.scheduler.running, self.costs)
        except Exception:  # drafts are only a speed-up: a failing draft model costs no request
            log.exception("speculative drafting failed; this step decodes without drafts")
            return {}

    def _expected_work_s(self, request: Request) -> float | None:
        """Seconds `request` takes alone at the measured costs (its prefill, then a lone
        decode per token it may make): how the scheduler puts short requests first."""
        costs = self.costs
        per_token_s, decode_s = costs.per_token_s, costs.single_decode_s
        if per_token_s is None or decode_s is None:
            return None
        return (
            request.num_prompt_tokens * per_token_s + request.sampling_params.max_tokens * decode_s
        )

    def _forced_drafts_worth(self, available: int) -> int:
        """How many grammar-forced tokens to propose as drafts: all are accepted, so the k
        with the most tokens per second at the measured step costs (a lone stream's by its
        own timed pass widths); "none" is reused for FORCED_WORTH_REUSE_CALLS calls. Before
        the costs are known, or when drafts are sized from fixed costs
        (SpecConfig.use_measured_costs off): all."""
        if self.speculator is not None and not self.speculator.config.use_measured_costs:
            return available
        costs = self.costs
        base_s, per_token_s = costs.base_s, costs.per_token_s
        if base_s is None or per_token_s is None:
            return available
        lone = len(self.scheduler.running) <= 1
        calls_left = self._forced_none_memo.get((available, lone), 0)
        if calls_left:  # none paid a moment ago: the (slowly moving) costs still say so
            self._forced_none_memo[available, lone] = calls_left - 1
            k = 0
        else:
            measured = costs.lone_pass_s if lone else ()
            k = best_draft_length(1.0, available, base_s, per_token_s, 0.0, measured)
            if k == 0:  # a positive k is recomputed each time: it may be a width to time
                self._forced_none_memo[available, lone] = FORCED_WORTH_REUSE_CALLS - 1
        if k == 0:  # now and then one rides anyway: a width timed under a load spike is retimed
            self._forced_idle_steps += 1
            if self._forced_idle_steps >= FORCED_DRAFT_RETRY_STEPS:
                self._forced_idle_steps = 0
                return 1
        return k

    def _one_pass(self, plan: StepPlan) -> bool:
        """Did the step run as one forward pass? A step whose lengths the executor ran as
        several passes costs a base per pass, which a line in tokens cannot fit."""
        return (
            not self.scheduler.config.one_pass_per_length
            or len({s.num_tokens for s in plan.seqs}) == 1
        )

    def _size_next_step(self) -> None:
        """Token budgets for the next step from the tiers running now, priority first: the
        priority cap (when a priority request runs), else the default tier's (its decodes
        running, no priority one)."""
        tiers = {r.tier for r in self.scheduler.running}
        self.step_token_budget = None
        if ServiceTier.PRIORITY in tiers:
            target_s: float | None = self.priority_itl_target_s
            if target_s == 0:  # auto: stay within 1.2x of the idle inter-token time
                target_s = self.costs.auto_itl_target_s()
            if target_s:  # the cap applies from the next step, to priority steps only
                self.priority_token_budget = self.costs.token_budget(target_s)
        elif ServiceTier.DEFAULT in tiers and self.default_itl_target_s:
            self.step_token_budget = self.costs.token_budget(self.default_itl_target_s)

    def _a_grammar_compiles(self) -> bool:
        """A grammar compiles now: for a request admitted meanwhile, or on any thread (the
        server compiles while a request's prompt is still being tokenized). A pass on every
        core beside it timeshares with the compile: on two cores a 1 ms decode then took
        10-22 ms (the kernel threads wait for each other while one is descheduled)."""
        return bool(self._compiling) or (
            self.grammar is not None and self.grammar.compiles_running > 0
        )

    def _steps_shorter_than_a_compile(self) -> bool:
        """A lone decode measured shorter than COMPILE_STEP_S: steps can be kept short while
        a grammar compiles (see COMPILE_STEP_S)."""
        decode_s = self.costs.single_decode_s
        return decode_s is not None and decode_s < COMPILE_STEP_S

    def _take_compiled_grammars(self, wait: bool) -> list[RequestOutput]:
        """Matchers for the requests whose compile has finished, and the first token of those
        whose prompt is already in (from its kept logits). A failed compile aborts its
        request (the server answers 400 from the same compile); an aborted request is
        forgotten. `wait`: nothing else to run, so wait a moment for a compile to end."""
        requests = self.scheduler.requests
        pending = [r.grammar_pending for r in self._compiling.values()]
        if wait and pending:
            concurrent.futures.wait(pending, COMPILE_POLL_S, concurrent.futures.FIRST_COMPLETED)
        outputs: list[RequestOutput] = []
        for request_id, request in list(self._compiling.items()):
            if requests.get(request_id) is not request:
                del self._compiling[request_id]
                self._kept.pop(request_id, None)
            elif request.grammar_pending.done():
                del self._compiling[request_id]
                kept = self._kept.pop(request_id, None)
                try:
                    request.grammar_matcher = self.grammar.matcher(
                        request.sampling_params.grammar, request.eos_token_ids
                    )
                except ValueError:  # GrammarError: the compile failed
                    self.abort(request_id)
                    continue
                if kept is not None:
                    outputs += self._sample_kept(request, kept)
        return outputs

    def _apply(
        self, plan: StepPlan, result: StepResult, constrained: dict[str, Request]
    ) -> StepOutcome:
        """The scheduler's update of a step (or of a kept row's sampling), and what follows
        it: the KV tier's write-through, the grammars' advance, the speculator's accounting;
        kept logits are held until their request's grammar is ready."""
        with self.pool_lock:
            clock = self.pool.clock
            outcome = self.scheduler.update(plan, result)
            if self.kv_cache is not None:  # write-through of the slots released now
                self.kv_cache.after_update(clock)
        outputs = outcome.outputs
        if constrained:  # only accepted tokens advance a grammar
            grammar_steps.advance(outputs, constrained)
        if self.speculator is not None:
            self.speculator.observe(
                outcome.verifications, [o.request_id for o in outputs if o.finished]
            )
        if result.kept_logits:
            self._kept.update(result.kept_logits)
        return outcome

    def _sample_kept(self, request: Request, kept: Any) -> list[RequestOutput]:
        """The first token of a request whose prompt prefilled while its grammar compiled,
        from the logits its last prompt token left (ScheduledSeq.defer_sample), under the
        mask now that the matcher exists: no pass of its own after the compile. Nothing if
        the request was preempted since (its prefill runs again and samples as usual)."""
        if request.num_computed_tokens != request.num_tokens or request.num_output_tokens:
            return []
        seq = ScheduledSeq(
            request_id=request.request_id,
            slot_id=request.held_slot_id,
            token_ids=[],  # nothing to compute: the prefill did
            start_position=request.num_tokens,
            num_logits=1,
            sampling_params=request.sampling_params,
            sampling_seed=request.sampling_seed,
            num_output_tokens=0,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
        )
        seq.token_mask = request.grammar_matcher.masks([])
        result = cast(KeptSampling, self.executor).sample_kept(seq, kept)
        return self._apply(StepPlan([seq]), result, {request.request_id: request}).outputs

    def step(self) -> list[RequestOutput]:
        early: list[RequestOutput] = []  # first tokens sampled from kept logits
        if self._compiling:
            early = self._take_compiled_grammars(wait=False)
            if early:  # out now: after this step's pass they would wait a whole step more
                return early
        tp = time.perf_counter()
        compiling = self._a_grammar_compiles()
        drafts: dict[str, Draft] = {}
        if self.speculator is not None and self.scheduler.running:
            drafts = self._propose(self.speculator)
        if self.grammar is not None:
            drafts = grammar_steps.constrain_drafts(
                drafts, self.scheduler.running, self._forced_drafts_worth
            )
        t0 = time.perf_counter()
        with self.pool_lock:  # the KV pool changes only under it: see cached_prefix_tokens
            if self.kv_cache is not None:
                self.kv_cache.release_held(self.scheduler)
                self.kv_cache.restore_waiting(self.scheduler, self.costs.per_token_s)
            token_budget = self.step_token_budget
            spare = compiling and self._steps_shorter_than_a_compile()
            if spare and self._compiling:  # short steps: the one after the compile runs in full
                short = self.costs.token_budget(COMPILE_STEP_S)
                if short is not None:
                    token_budget = short if token_budget is None else min(token_budget, short)
            plan = self.scheduler.schedule(drafts, self.priority_token_budget, token_budget)
        if spare:  # a core for the compile, which its request (or one on its way) waits on
            plan.spare_threads = COMPILE_SPARE_THREADS
        constrained = (
            grammar_steps.fill_masks(plan, self.scheduler.requests) if self.grammar else {}
        )
        t1 = time.perf_counter()
        if plan.seqs:
            try:
                result = self.executor.execute(plan)
            except Exception as exc:  # the whole step failed: fail its requests, keep serving
                log.exception("step %d failed", plan.step_id)
                error = f"engine step failed: {type(exc).__name__}"
                result = StepResult(errors={s.request_id: error for s in plan.seqs})
        else:
            result = StepResult()
            if self._compiling:  # only compiles to wait for: do not spin
                early += self._take_compiled_grammars(wait=True)
        t2 = time.perf_counter()
        outcome = self._apply(plan, result, constrained)
        outputs = early + outcome.outputs if early else outcome.outputs
        t3 = time.perf_counter()
        seqs = plan.seqs
        num_tokens = num_drafts = 0
        for seq in seqs:
            num_tokens += len(seq.token_ids)
            num_drafts += seq.num_logits - 1 if seq.num_logits > 1 else 0
        # a pass beside a compile (or on a core fewer for it) times the contention, not the
        # model: the costs that size steps and decide spare cores learn from the others only
        if seqs and self._one_pass(plan) and not (compiling or self._a_grammar_compiles()):
            pass_s = result.execute_time_s + result.sample_time_s
            self.costs.observe(len(seqs), num_tokens, pass_s + t0 - tp, pass_s)
        if seqs:
            self._size_next_step()
        self.last_stats = StepStats(
            step_id=plan.step_id,
            num_seqs=len(seqs),
            num_tokens=num_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            schedule_time_s=t1 - t0,
            execute_time_s=result.execute_time_s,
            sample_time_s=result.sample_time_s,
            update_time_s=t3 - t2,
            propose_time_s=t0 - tp,
            num_draft_tokens=num_drafts,
        )
        return outputs
