"""The synchronous step loop: propose -> schedule -> execute -> update (then observe).

The engine sees token ids only. `EngineCore` owns the scheduler, the KV slot pool, the step
cost model and budget, the speculator, the grammar stage (engine/grammar_stage.py) and the
tiered KV cache; `engine.thread.EngineThread` runs it for the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

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
from ultrafast.engine.grammar_stage import GrammarStage
from ultrafast.engine.idle_speed import IdleSpeed
from ultrafast.engine.speculation import SpeculationStats, Speculator
from ultrafast.engine.start_costs import StartCosts
from ultrafast.engine.step_costs import StepBudget, StepCostModel, StepStats
from ultrafast.executors.base import Executor, KeptSampling
from ultrafast.kvcache.manager import KVCacheConfig, KVCacheManager
from ultrafast.request import Request, SamplingParams, ServiceTier

if TYPE_CHECKING:
    from ultrafast.grammar.matcher import GrammarRuntime

log = logging.getLogger(__name__)


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
        grammar: GrammarRuntime | None = None,
    ):
        """priority_itl_target_s: None = no cap on steps carrying priority work, 0 = auto.
        speculator: None for plain decoding (client predictions are then ignored).
        kv_cache: the tiered KV cache (host memory, disk, Redis) under the slots, if enabled.
        default_itl_target_s: the default tier's token gap; steps that carry its decodes (and
        no priority work) are sized to it. None = no cap.
        grammar: the runtime for constrained requests (None: they are refused).
        """
        if config.max_num_seqs > executor.num_slots:
            raise ValueError("max_num_seqs cannot exceed the executor's KV slots")
        if config.max_model_len > executor.max_model_len:
            raise ValueError("max_model_len cannot exceed the executor's slot length")
        self.executor = executor
        self.caps = caps = executor.caps()
        config = replace(
            config, one_pass_per_length=config.one_pass_per_length or caps.one_pass_per_length
        )
        self.pool = KVSlotPool(executor.num_slots)
        # held while the pool changes, so another thread may read it (cached_prefix_tokens)
        self.pool_lock = threading.Lock()
        self.scheduler = Scheduler(
            config, self.pool, self._expected_work_s, keeps_logits=caps.keeps_logits
        )
        self.last_stats: StepStats | None = None
        self.costs = StepCostModel()
        self.budget = StepBudget(priority_itl_target_s, default_itl_target_s)
        self.speculator = speculator
        self.grammar = grammar
        measured = speculator is None or speculator.config.use_measured_costs
        self.grammar_stage = GrammarStage(grammar, self._run_kept, self.abort, measured)
        self.idle_speed: IdleSpeed | None = None  # timed by warmup(measure_speed=True)
        self.start_costs = StartCosts(self)
        self.kv_cache: KVCacheManager | None = None
        if kv_cache is not None and kv_cache.enabled:
            self.kv_cache = KVCacheManager(kv_cache, executor, self.pool)

    @property
    def speculation_stats(self) -> SpeculationStats | None:
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
        self.grammar_stage.admit(request)  # its matcher, or it waits for its compile
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

    def step(self) -> list[RequestOutput]:
        """One step: propose -> schedule -> execute -> update, then observe its costs."""
        early = self.grammar_stage.before_schedule(self.scheduler.requests)
        if early:  # first tokens from kept logits: out now, not after this step's pass
            return early
        tp = time.perf_counter()
        compiling = self.grammar_stage.compiles_now()
        drafts = self._propose()
        t0 = time.perf_counter()
        plan = self._schedule(drafts, compiling)
        constrained = self.grammar_stage.fill_masks(plan, self.scheduler.requests)
        t1 = time.perf_counter()
        result, early = self._execute(plan)
        t2 = time.perf_counter()
        outputs = self._apply(plan, result, constrained).outputs
        t3 = time.perf_counter()
        self._observe(plan, result, compiling, (tp, t0, t1, t2, t3))
        return early + outputs if early else outputs

    def _propose(self) -> dict[str, Draft]:
        """Drafts for the running requests (speculation), cut to their grammars, and the
        tokens their grammars force."""
        running, speculator = self.scheduler.running, self.speculator
        drafts: dict[str, Draft] = {}
        if speculator is not None and running:
            try:  # k is sized by the measured step cost
                drafts = speculator.propose(running, self.costs)
            except Exception:  # drafts are only a speed-up: a failing draft model costs none
                log.exception("speculative drafting failed; this step decodes without drafts")
        return self.grammar_stage.constrain(drafts, running, self.costs)

    def _schedule(self, drafts: dict[str, Draft], compiling: bool) -> StepPlan:
        """The KV tier's restores, then the scheduler's plan under the step budgets (shorter,
        and a core fewer, while a grammar compiles)."""
        spare_threads, cap = self.grammar_stage.step_shape(compiling, self.costs)
        with self.pool_lock:  # the KV pool changes only under it: see cached_prefix_tokens
            if self.kv_cache is not None:
                self.kv_cache.before_schedule(self.scheduler, self.costs.per_token_s)
            plan = self.scheduler.schedule(
                drafts, self.budget.priority_tokens, self.budget.capped(cap)
            )
        if spare_threads:  # a core for the compile, which its request (or one coming) waits on
            plan.spare_threads = spare_threads
        return plan

    def _execute(self, plan: StepPlan) -> tuple[StepResult, list[RequestOutput]]:
        """The executor's pass; an empty plan waits a moment for a grammar compile instead
        (its first tokens, from kept logits, come back beside the empty result)."""
        if not plan.seqs:
            return StepResult(), self.grammar_stage.when_idle(self.scheduler.requests)
        try:
            return self.executor.execute(plan), []
        except Exception as exc:  # the whole step failed: fail its requests, keep serving
            log.exception("step %d failed", plan.step_id)
            error = f"engine step failed: {type(exc).__name__}"
            return StepResult(errors={s.request_id: error for s in plan.seqs}), []

    def _apply(
        self, plan: StepPlan, result: StepResult, constrained: dict[str, Request]
    ) -> StepOutcome:
        """The scheduler's update of a step (or of a kept row's sampling), and what follows
        it: the KV tier's write-through, the grammars' advance, the speculator's accounting."""
        with self.pool_lock:
            clock = self.pool.clock
            outcome = self.scheduler.update(plan, result)
            if self.kv_cache is not None:  # write-through of the slots released now
                self.kv_cache.after_update(clock)
        outputs = outcome.outputs
        self.grammar_stage.after_update(outputs, constrained, result)
        if self.speculator is not None:
            self.speculator.observe(
                outcome.verifications, [o.request_id for o in outputs if o.finished]
            )
        return outcome

    def _run_kept(
        self, seq: ScheduledSeq, kept: Any, constrained: dict[str, Request]
    ) -> list[RequestOutput]:
        """The grammar stage's sampling of a kept row, updated like a step of its own."""
        result = cast(KeptSampling, self.executor).sample_kept(seq, kept)
        return self._apply(StepPlan([seq]), result, constrained).outputs

    def _observe(
        self, plan: StepPlan, result: StepResult, compiling: bool, times: tuple[float, ...]
    ) -> None:
        """After the update: the step costs learn from the pass, the next step's budgets are
        sized, and the step's numbers are kept for metrics."""
        tp, t0, t1, t2, t3 = times
        seqs = plan.seqs
        num_tokens = num_drafts = 0
        for seq in seqs:
            num_tokens += len(seq.token_ids)
            num_drafts += seq.num_logits - 1 if seq.num_logits > 1 else 0
        # a pass beside a compile (or on a core fewer for it) times the contention, not the
        # model: the costs that size steps and decide spare cores learn from the others only
        one_pass = self._one_pass(plan) if result.num_passes is None else result.num_passes == 1
        if seqs and one_pass and not (compiling or self.grammar_stage.compiles_now()):
            pass_s = result.execute_time_s + result.sample_time_s
            self.costs.observe(len(seqs), num_tokens, pass_s + t0 - tp, pass_s)
        if seqs:
            self.budget.resize(self.costs, (r.tier for r in self.scheduler.running))
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

    def _one_pass(self, plan: StepPlan) -> bool:
        """Did the step run as one forward pass? A step whose lengths the executor ran as
        several passes costs a base per pass, which a line in tokens cannot fit."""
        return (
            not self.scheduler.config.one_pass_per_length
            or len({s.num_tokens for s in plan.seqs}) == 1
        )
