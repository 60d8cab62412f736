"""The step loop: schedule -> execute -> update, synchronously (EngineCore) or on its own thread.

The engine sees token ids only. `EngineThread` is the boundary to the server: requests and
aborts go in through one queue, outputs come back through a per-request callback (the server
wraps it with `loop.call_soon_threadsafe`). Moving the engine to its own process later changes
only that boundary.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from ultrafast.core.kv_pool import KVSlotPool
from ultrafast.core.scheduler import RequestOutput, Scheduler, SchedulerConfig
from ultrafast.core.types import StepResult
from ultrafast.executors.base import Executor
from ultrafast.request import Request, SamplingParams, ServiceTier

log = logging.getLogger(__name__)


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


MAX_TABULATED_STEP_TOKENS = 16  # lone steps up to this many tokens are timed per size


class StepCostModel:
    """Step time ~ base_s + per_seq_s * (num_seqs - 1) + per_token_s * num_tokens, fitted online
    (exponentially weighted least squares), plus the time of a lone single-token step.

    Sizes each step while a priority request decodes, so its inter-token gap stays within
    target however much other work is waiting. A sequence and a token are fitted apart: on a
    CPU one more 1-token decode in a step can cost several prefill tokens' time (its own KV
    stream, sampling, output), so a token count alone mispredicts a step of many decodes.
    """

    def __init__(self, forget: float = 0.05):
        self.forget = forget
        self._sums = [0.0] * 9  # weight, s, t, y, ss, tt, st, sy, ty (s = num_seqs - 1)
        self._base_s: float | None = None  # one sequence: base_s + per_token_s * num_tokens
        self._per_token_s: float | None = None
        self._per_seq_s = 0.0  # each sequence past the first (0 until the data can tell)
        self._stale = False  # observed since the last fit: fitted when a figure is read
        self.single_decode_s: float | None = None  # one sequence, one token: the idle ITL
        # forward pass + sampling of one sequence's step of n tokens (index n), measured apart:
        # on a CPU the first extra token costs far more than the line says (q4_0 demo model:
        # 0.92 ms for 1 token, 1.70 ms for 2, 2.41 ms for 3), which sizes speculation's k
        self.lone_pass_s: list[float | None] = [None] * (MAX_TABULATED_STEP_TOKENS + 1)

    # The fit is made when read, not at every step: a lone stream's steps never read it, and
    # the fit is a few microseconds of Python in a step whose host side is ~100 us.
    @property
    def base_s(self) -> float | None:
        self._refit()
        return self._base_s

    @property
    def per_token_s(self) -> float | None:
        self._refit()
        return self._per_token_s

    @property
    def per_seq_s(self) -> float:
        self._refit()
        return self._per_seq_s

    def _refit(self) -> None:
        if self._stale:
            self._stale = False
            self._fit()

    def observe(self, num_seqs: int, num_tokens: int, elapsed_s: float,
                pass_s: float | None = None) -> None:
        """One step: its sequences, tokens and time; `pass_s`, the part that was the forward
        pass and sampling (without drafting), feeds `lone_pass_s`."""
        if num_tokens == 0 or elapsed_s <= 0:
            return
        if num_seqs == 1 and num_tokens == 1:
            self.single_decode_s = _ema(self.single_decode_s, elapsed_s, 0.1)
        if num_seqs == 1 and num_tokens <= MAX_TABULATED_STEP_TOKENS and pass_s:
            self.lone_pass_s[num_tokens] = _ema(self.lone_pass_s[num_tokens], pass_s, 0.2)
        keep = 1.0 - self.forget
        s, t, y = float(num_seqs - 1), float(num_tokens), elapsed_s
        new = (1.0, s, t, y, s * s, t * t, s * t, s * y, t * y)
        self._sums = [v * keep + d for v, d in zip(self._sums, new)]
        self._stale = True

    def _fit(self) -> None:
        _, s, t, y, ss, tt, st, sy, ty = (v / self._sums[0] for v in self._sums)
        var_s, var_t, cov_st = ss - s * s, tt - t * t, st - s * t
        cov_sy, cov_ty = sy - s * y, ty - t * y
        if var_t <= 0.5:  # not enough spread in step sizes to trust a slope
            return
        det = var_s * var_t - cov_st * cov_st
        if var_s > 0.25 and det > 0.05 * var_s * var_t:  # sequences and tokens vary apart
            per_seq = (cov_sy * var_t - cov_ty * cov_st) / det
            per_token = (cov_ty * var_s - cov_sy * cov_st) / det
            if per_seq >= 0 and per_token > 0:
                self._per_seq_s, self._per_token_s = per_seq, per_token
                self._base_s = max(y - per_seq * s - per_token * t, 0.0)
                return
        slope = cov_ty / var_t  # tokens alone (e.g. a single stream: prefills and decodes)
        if slope > 0:
            self._per_seq_s, self._per_token_s = 0.0, slope
            self._base_s = max(y - slope * t, 0.0)

    def token_budget(self, target_s: float, minimum: int = 1) -> int | None:
        """Tokens a step may hold and still take <= target_s, counting every token past the
        first as a sequence of its own (the dearest way to spend it)."""
        base_s, per_token_s = self.base_s, self.per_token_s
        if base_s is None or per_token_s is None:
            return None
        first_s = base_s + per_token_s
        return max(minimum, 1 + int((target_s - first_s) / (per_token_s + self._per_seq_s)))

    def auto_itl_target_s(self, factor: float = 1.2) -> float | None:
        """`factor` times the idle inter-token time, once it has been measured.

        Once the model is fitted, the idle time is its own prediction of a lone decode, so
        target and budget come from one line: a measured lone decode carries noise (a
        longer context, the HTTP thread on the same core) and a high reading once let a
        second sequence into every priority step, slowing it by half."""
        base_s, per_token_s = self.base_s, self.per_token_s
        if base_s is not None and per_token_s is not None:
            return factor * (base_s + per_token_s)
        return None if self.single_decode_s is None else factor * self.single_decode_s


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


class EngineCore:
    """Synchronous engine: call `step()` until `has_work()` is False."""

    def __init__(self, executor: Executor, config: SchedulerConfig,
                 priority_itl_target_s: float | None = None, speculator=None):
        """priority_itl_target_s: None = no cap on steps carrying priority work, 0 = auto.
        speculator: a runtime.spec.Speculator, or None for plain decoding (predictions ignored).
        """
        if config.max_num_seqs > executor.num_slots:
            raise ValueError("max_num_seqs cannot exceed the executor's KV slots")
        if config.max_model_len > executor.max_model_len:
            raise ValueError("max_model_len cannot exceed the executor's slot length")
        self.executor = executor
        config = replace(config, one_pass_per_length=config.one_pass_per_length
                         or getattr(executor, "one_pass_per_length", False))
        self.pool = KVSlotPool(executor.num_slots)
        self.scheduler = Scheduler(config, self.pool)
        self.last_stats: StepStats | None = None
        self.priority_itl_target_s = priority_itl_target_s
        self.costs = StepCostModel()
        self.speculator = speculator

    @property
    def spec_stats(self):
        """runtime.spec.SpecStats (drafted / accepted per source), or None without speculation."""
        return None if self.speculator is None else self.speculator.stats

    def warmup(self, num_prompt_tokens: int = 16) -> None:
        """Run a short prefill and decode before serving: the first pass of a fresh executor
        allocates its compute graph and would otherwise land on the first client's TTFT."""
        prompt = [i % self.executor.vocab_size for i in range(1, num_prompt_tokens + 1)]
        self.add_request(Request("warmup", prompt, SamplingParams(  # priority: drafting warms too
            temperature=0.0, max_tokens=4, ignore_eos=True), tier=ServiceTier.PRIORITY))
        while self.has_work():
            self.step()
        self.pool.reset_cache()
        self.costs = StepCostModel()  # learn from real traffic, not from the cold first pass

    def add_request(self, request: Request) -> None:
        for token in request.prompt_token_ids:
            if not 0 <= token < self.executor.vocab_size:
                raise ValueError(f"token id {token} is out of vocabulary "
                                 f"(size {self.executor.vocab_size})")
        if self.speculator is not None:
            self.speculator.admit(request)
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def occupancy(self) -> EngineOccupancy:
        sched, pool = self.scheduler, self.pool
        running = [0, 0, 0]  # ServiceTier values 0..2
        for request in sched.running:
            running[request.tier] += 1
        waiting = sched.waiting
        return EngineOccupancy(
            num_waiting_by_tier=(len(waiting[ServiceTier.PRIORITY]),
                                 len(waiting[ServiceTier.DEFAULT]), len(waiting[ServiceTier.FLEX])),
            num_running_by_tier=tuple(running), num_kv_slots_running=pool.num_running,
            num_kv_slots_total=pool.num_slots, num_prefix_queries=pool.num_prefix_queries,
            num_prefix_query_tokens=pool.num_prefix_query_tokens,
            num_prefix_hit_tokens=pool.num_prefix_hit_tokens,
            num_preemptions=sched.num_preemptions)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _propose(self) -> None:
        running = self.scheduler.running
        self.speculator.step_costs = self.costs  # k is sized by the measured step cost
        try:
            drafts = self.speculator.propose(running)
        except Exception:  # drafts are only a speed-up: a failing draft model costs no request
            log.exception("speculative drafting failed; this step decodes without drafts")
            drafts = {}
        for request in running:
            request.draft = drafts.get(request.request_id)

    def _one_pass(self, plan) -> bool:
        """Did the step run as one forward pass? A step whose lengths the executor ran as
        several passes costs a base per pass, which a line in tokens cannot fit."""
        return (not self.scheduler.config.one_pass_per_length
                or len({s.num_tokens for s in plan.seqs}) == 1)

    def step(self) -> list[RequestOutput]:
        tp = time.perf_counter()
        if self.speculator is not None and self.scheduler.running:
            self._propose()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        if plan.seqs:
            try:
                result = self.executor.execute(plan)
            except Exception as exc:  # the whole step failed: fail its requests, keep serving
                log.exception("step %d failed", plan.step_id)
                result = StepResult(errors={s.request_id: f"engine step failed: {type(exc).__name__}"
                                            for s in plan.seqs})
        else:
            result = StepResult()
        t2 = time.perf_counter()
        outputs = self.scheduler.update(plan, result)
        if self.speculator is not None:
            self.speculator.observe(plan, [o.request_id for o in outputs if o.finished])
        t3 = time.perf_counter()
        seqs = plan.seqs
        num_tokens = num_drafts = 0
        for seq in seqs:
            num_tokens += len(seq.token_ids)
            num_drafts += seq.num_logits - 1 if seq.num_logits > 1 else 0
        if seqs and self._one_pass(plan):
            pass_s = result.execute_time_s + result.sample_time_s
            self.costs.observe(len(seqs), num_tokens, pass_s + t0 - tp, pass_s)
        if seqs and self.priority_itl_target_s is not None and any(
                r.tier == ServiceTier.PRIORITY for r in self.scheduler.running):
            target_s = self.priority_itl_target_s
            if target_s == 0:  # auto: stay within 1.2x of the idle inter-token time
                target_s = self.costs.auto_itl_target_s()
            if target_s:  # the cap applies from the next step, to priority steps only
                self.scheduler.priority_step_token_budget = self.costs.token_budget(target_s)
        self.last_stats = StepStats(
            step_id=plan.step_id, num_seqs=len(seqs), num_tokens=num_tokens,
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting,
            schedule_time_s=t1 - t0, execute_time_s=result.execute_time_s,
            sample_time_s=result.sample_time_s, update_time_s=t3 - t2, propose_time_s=t0 - tp,
            num_draft_tokens=num_drafts)
        return outputs



# ---- read API for the server (through server/bridge.py only) --------------------------------
# The server never touches EngineCore, its scheduler or its KV pool: it reads an immutable
# snapshot the engine thread publishes, asks for cached prefixes under a lock, and changes
# settings through the inbox. Moving the engine to its own process then changes bridge.py only.

SNAPSHOT_MAX_AGE_S = 0.02  # a busy engine republishes at most this stale; idle: at once


@dataclass(frozen=True)
class StepCostSnapshot:
    """The step-cost fit's coefficients at one moment (None: not measured yet)."""

    base_s: float | None = None
    per_token_s: float | None = None
    per_seq_s: float = 0.0
    single_decode_s: float | None = None  # one sequence, one token: the idle inter-token time

    @property
    def measured(self) -> bool:
        return self.base_s is not None and self.per_token_s is not None

    def predict_s(self, num_tokens: int, fallback: tuple[float, float] = (0.01, 0.002)) -> float:
        """One step holding `num_tokens` tokens of one sequence; before any measurement, the
        `fallback` (base_s, per_token_s) stands in."""
        base_s, per_token_s = ((self.base_s, self.per_token_s) if self.measured else fallback)
        return base_s + num_tokens * per_token_s  # type: ignore[operator]

    @classmethod
    def of(cls, costs: StepCostModel) -> "StepCostSnapshot":
        return cls(costs.base_s, costs.per_token_s, costs.per_seq_s, costs.single_decode_s)


@dataclass(frozen=True)
class EngineSnapshot:
    """What the server may know of the engine, as of one step. Field names match
    EngineOccupancy's, so metrics reads either."""

    step_id: int = -1  # the last step run (-1: none yet)
    num_waiting_by_tier: tuple[int, ...] = (0, 0, 0)  # indexed by ServiceTier value
    num_running_by_tier: tuple[int, ...] = (0, 0, 0)
    num_kv_slots_running: int = 0
    num_kv_slots_total: int = 0
    num_prefix_queries: int = 0  # cumulative counters from here down
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    step_costs: StepCostSnapshot = StepCostSnapshot()
    # speculative decoding, per draft source (empty without speculation)
    spec_draft_tokens: tuple[tuple[str, int], ...] = ()
    spec_accepted_tokens: tuple[tuple[str, int], ...] = ()
    device_kind: str = "cpu"  # "cpu" or "gpu"
    max_model_len: int = 0  # the scheduler's limits, fixed at start
    max_num_seqs: int = 0

    @property
    def num_running(self) -> int:
        return sum(self.num_running_by_tier)

    @property
    def num_waiting(self) -> int:
        return sum(self.num_waiting_by_tier)

    @property
    def num_draft_tokens(self) -> dict[str, int]:  # SpecStats' names, for metrics
        return dict(self.spec_draft_tokens)

    @property
    def num_accepted_tokens(self) -> dict[str, int]:
        return dict(self.spec_accepted_tokens)


@dataclass(frozen=True)
class EngineSettings:
    """Settings the server may change while serving; None leaves a setting as it is."""

    reserved_priority_seats: dict[str, int] | None = None  # tenant -> committed KV seats


def device_kind_of(executor: Executor) -> str:
    device = getattr(executor, "device", None)
    return "gpu" if getattr(device, "type", "cpu") == "cuda" else "cpu"


def build_snapshot(core: EngineCore, device_kind: str) -> EngineSnapshot:
    """On the engine thread: copy every figure out, so readers share nothing mutable."""
    occ = core.occupancy()
    spec = core.spec_stats
    return EngineSnapshot(
        step_id=core.last_stats.step_id if core.last_stats is not None else -1,
        num_waiting_by_tier=occ.num_waiting_by_tier, num_running_by_tier=occ.num_running_by_tier,
        num_kv_slots_running=occ.num_kv_slots_running, num_kv_slots_total=occ.num_kv_slots_total,
        num_prefix_queries=occ.num_prefix_queries,
        num_prefix_query_tokens=occ.num_prefix_query_tokens,
        num_prefix_hit_tokens=occ.num_prefix_hit_tokens, num_preemptions=occ.num_preemptions,
        step_costs=StepCostSnapshot.of(core.costs),
        spec_draft_tokens=tuple(sorted(spec.num_draft_tokens.items())) if spec else (),
        spec_accepted_tokens=tuple(sorted(spec.num_accepted_tokens.items())) if spec else (),
        device_kind=device_kind, max_model_len=core.scheduler.config.max_model_len,
        max_num_seqs=core.scheduler.config.max_num_seqs)


class EngineReadAPI:
    """Mixed into EngineThread: the snapshot, the cached-prefix lookup and `configure`.

    The prefix lookup takes `pool_lock`, which the engine thread holds while it runs a step
    or handles an inbox item (the only times the KV pool changes). A lookup so waits at most
    one step, which costs the caller nothing: its request could not join before that step
    ends anyway. A published copy of every slot's block hashes would instead cost each step
    a copy of the whole pool index for a lookup made once per API call."""

    core: EngineCore
    pool_lock: threading.Lock
    device_kind: str
    _snapshot: EngineSnapshot
    _snapshot_s: float

    def snapshot(self) -> EngineSnapshot:
        """The latest published snapshot (any thread; a plain attribute read)."""
        return self._snapshot

    def cached_prefix_tokens(self, token_ids: list[int], tenant: str) -> int:
        """Leading tokens of `token_ids` some KV slot holds for `tenant` now (any thread)."""
        with self.pool_lock:
            return self.core.pool.num_cached_prefix_tokens(token_ids, tenant)

    def configure(self, settings: EngineSettings) -> None:
        """Applied on the engine thread before its next step (any thread)."""
        self._inbox.put(("configure", settings, None))  # type: ignore[attr-defined]

    def _apply_settings(self, settings: EngineSettings) -> None:
        if settings.reserved_priority_seats is not None:
            self.core.scheduler.reserved_priority_seats = dict(settings.reserved_priority_seats)

    def _publish(self, force: bool) -> None:
        """Engine thread, after a step: a fresh snapshot when the engine went idle, when
        forced, or when the last one is older than SNAPSHOT_MAX_AGE_S (a busy engine's
        per-step cost stays one clock read)."""
        now = time.monotonic()
        if force or now - self._snapshot_s >= SNAPSHOT_MAX_AGE_S:
            self._snapshot = build_snapshot(self.core, self.device_kind)
            self._snapshot_s = now

OutputCallback = Callable[[RequestOutput], None]


class EngineThread(EngineReadAPI):
    """Runs an EngineCore on a daemon thread. Thread-safe `submit` and `abort`."""

    def __init__(self, core: EngineCore, on_stats: Callable[[StepStats], None] | None = None,
                 shaper_window_s: float = 0.0):
        self.core = core
        # Request shaper: default/flex arrivals wait up to this long so a burst joins one step;
        # a priority arrival ends the wait at once.
        self.shaper_window_s = shaper_window_s
        self._first_shaped_arrival_s: float | None = None
        self._priority_arrived = False
        self.on_stats = on_stats
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._thread = threading.Thread(target=self._run, name="ultrafast-engine", daemon=True)
        self._stopping = threading.Event()
        self._warmup = False
        self._warmed = threading.Event()
        self.dead_reason: str | None = None
        # read API (EngineReadAPI above): the snapshot and the lock around pool changes
        self.pool_lock = threading.Lock()
        self.device_kind = device_kind_of(core.executor)
        self._snapshot = build_snapshot(core, self.device_kind)
        self._snapshot_s = time.monotonic()

    def start(self, warmup: bool = False, timeout_s: float = 600.0) -> "EngineThread":
        """Start the thread; with `warmup`, it first runs `core.warmup()` and this returns
        once that is done.

        Warm up here, not on the caller's thread: llama.cpp's CPU threads come from OpenMP,
        and once one thread has run a pass, passes run from any other thread do not get the
        extra threads' speed (a 73-token prefill with 2 threads: 13.4 ms from the thread
        that warmed up, 20.8 ms from another, the 1-thread time)."""
        self._warmup = warmup
        self._warmed.clear()
        self._thread.start()
        if warmup and not self._warmed.wait(timeout_s):
            raise RuntimeError("the engine did not warm up in time")
        if self.dead_reason is not None:
            raise RuntimeError(f"the engine thread died while warming up: {self.dead_reason}")
        return self

    def submit(self, request: Request, on_output: OutputCallback) -> None:
        self._inbox.put(("add", request, on_output))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead_reason is None

    def _drain_inbox(self, block: bool) -> bool:
        """Handle every queued item; False if there was none."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, kind: str, payload, on_output: OutputCallback | None) -> None:
        if kind == "add":
            try:
                with self.pool_lock:
                    self.core.add_request(payload)
            except (ValueError, OverflowError) as exc:
                on_output(RequestOutput(payload.request_id, [], finished=True,
                                        finish_reason="error", error=str(exc)))
                return
            self._callbacks[payload.request_id] = on_output
            if payload.tier == ServiceTier.PRIORITY:
                self._priority_arrived = True
            elif self._first_shaped_arrival_s is None:
                self._first_shaped_arrival_s = time.monotonic()
        elif kind == "abort":
            with self.pool_lock:
                self.core.abort(payload)
        elif kind == "configure":
            self._apply_settings(payload)

    def _run(self) -> None:
        try:
            if self._warmup:
                with self.pool_lock:
                    self.core.warmup()
            self._publish(force=True)
            self._warmed.set()
            while not self._stopping.is_set():
                handled = self._drain_inbox(block=not self.core.has_work())
                if not self.core.has_work():
                    if handled:
                        self._publish(force=True)
                    continue
                self._coalesce()
                with self.pool_lock:
                    outputs = self.core.step()
                self._publish(force=not self.core.has_work())
                for output in outputs:
                    callback = self._callbacks.get(output.request_id)
                    if output.finished:
                        self._callbacks.pop(output.request_id, None)
                    if callback is not None:
                        self._deliver(callback, output)
                if self.on_stats is not None and self.core.last_stats is not None:
                    self.on_stats(self.core.last_stats)
        except BaseException as exc:  # fatal: tell every waiter, then die visibly
            self.dead_reason = f"{type(exc).__name__}"
            log.exception("engine thread died")
            self._warmed.set()  # a failed warm-up must not leave start() waiting
            for request_id, callback in list(self._callbacks.items()):
                self._deliver(callback, RequestOutput(request_id, [], finished=True,
                                                      finish_reason="error",
                                                      error="engine failed"))
            self._callbacks.clear()

    def _coalesce(self) -> None:
        """Hold a step for the shaper window while only default/flex arrivals are new."""
        first = self._first_shaped_arrival_s
        priority_running = any(r.tier == ServiceTier.PRIORITY for r in self.core.scheduler.running)
        if self.shaper_window_s > 0 and first is not None and not priority_running:
            deadline = first + self.shaper_window_s
            while not self._priority_arrived and not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    self._handle(*self._inbox.get(timeout=left))
                except queue.Empty:
                    break
        self._first_shaped_arrival_s = None
        self._priority_arrived = False

    @staticmethod
    def _deliver(callback: OutputCallback, output: RequestOutput) -> None:
        try:
            callback(output)
        except Exception:  # a broken consumer must not stop the engine
            log.exception("output callback failed for %s", output.request_id)
