"""Start costs: what the engine measures about this machine before it can serve at its best,
measured once per (CPU, model file, flags), cached, reused, and re-checked when they drift.

Two figures: the ggml executor's threads per pass width (executors/ggml_threads.py) and the
idle speed of a typical prompt (engine/idle_speed.py: the auto TTFT targets follow it). Timing
them took seconds on an idle machine and far longer while other processes used the cores, and
a start used to wait for them before binding its port. Now:

- a cached result (`$ULTRAFAST_CACHE_DIR/start-costs/<key>.json`, the key hashing the CPU's
  model, flags and usable cores, the model file's path, size and mtime, and the executor's
  flags) is applied at once;
- with nothing cached the server serves at once on a safe default (every core but one for a
  one-token pass, every core for a wider one unless other processes were busy on them:
  unmeasured_plan) and measures in the background: only while the engine has been idle,
  the measurement giving way between two passes to any request that arrives (and starting
  again later);
- a plan timed under contention (ggml_threads.py) is used but not cached, and measured again
  after CONTENDED_RECHECK_S;
- once serving, lone decodes are compared with the plan's timing: when their median over
  DRIFT_SAMPLES is DRIFT_FACTOR off either way, the plan is measured again in the background.
  Such a re-check times the thread plan only, in consecutive slots that hold nothing (a
  conversation's cached prefix is never dropped for it; without room it waits).

Offline users (LLM, the benchmarks' in-process engine) measure synchronously when nothing is
cached (`warmup(background=False)`).
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, cast

from ultrafast import cpu_contention
from ultrafast.cpu_info import cpu_identity
from ultrafast.engine.idle_speed import CoreView, IdleSpeed, measure_idle_speed
from ultrafast.executors.base import ThreadCalibration
from ultrafast.executors.cost_cache import read_cache, write_cache
from ultrafast.executors.ggml_threads import CalibrationInterrupted, NoFreeSlots, ThreadPlan

if TYPE_CHECKING:
    from ultrafast.engine.step_costs import StepStats

log = logging.getLogger("ultrafast")

DRIFT_SAMPLES = 32  # lone decodes compared with the plan's timing...
DRIFT_FACTOR = 2.0  # ...and this far off (either way) means the plan is measured again
MIN_RECHECK_INTERVAL_S = 300.0  # at most one drift re-check per this long
CONTENDED_RECHECK_S = 60.0  # a plan timed under contention is measured again after this
NO_ROOM_RETRY_S = 10.0  # a re-check finding no free consecutive slots tries again after this
# a start's background measurement waits this long after the warm-up: the first request of a
# user who starts the server and asks at once (its template and tokens take a moment before
# it reaches the engine) is served before the timings begin, not queued behind their first
# passes
FIRST_MEASURE_DELAY_S = 2.0


def safe_threads(cores: int) -> int:
    """Threads per one-token pass until measured: every core but one. On a machine whose
    cores another process also uses, a pass on every core waits at each barrier for a thread
    that is not running (a 128-token prefill took 1.6 s on two threads against 37 ms on one)."""
    return max(1, cores - 1)


BUSY_NEIGHBOURS_CORES = 0.5  # other processes using this much of our cores: a busy machine


def unmeasured_plan(cores: int, others_busy: float | None) -> ThreadPlan:
    """The plan until measured. A lone decode (one token: memory-bound, its threads spin
    against the event loop) on every core but one. Any wider pass, a prompt's prefill first
    of all, on every core (llama.cpp's own default, and the fastest on an idle machine: a cold
    start's first 37-token prompt took 300 ms on one of two cores) unless other processes kept
    `others_busy` cores busy meanwhile (cpu_contention.py): then on every core but one."""
    if others_busy is not None and others_busy >= BUSY_NEIGHBOURS_CORES:
        return ThreadPlan((1,), (safe_threads(cores),))
    return ThreadPlan((1, 2), (safe_threads(cores), cores))


def load_cached(identity: dict) -> tuple[ThreadPlan | None, IdleSpeed | None] | None:
    """The cached plan and idle speed for this identity, or None (absent, unreadable, stale)."""
    data = read_cache(identity)
    if data is None:
        return None
    try:
        plan = ThreadPlan.from_json(data["thread_plan"]) if data.get("thread_plan") else None
        speed = IdleSpeed(**data["idle_speed"]) if data.get("idle_speed") else None
    except (ValueError, KeyError, TypeError):
        return None
    return plan, speed


def store_cached(identity: dict, plan: ThreadPlan | None, speed: IdleSpeed | None) -> None:
    write_cache(
        identity,
        {
            "thread_plan": plan.to_json() if plan else None,
            "idle_speed": asdict(speed) if speed else None,
        },
    )


class StartCosts:
    """The engine's start costs: from the cache, or measured (at once or in the background)."""

    def __init__(self, core: CoreView):
        self.core = core
        self.status = "not measured"  # cached | measuring | measured | contended | ...
        self.pending = False  # measure when the engine is next idle (engine thread)
        self._recheck_at = 0.0  # monotonic time before which a pending measure waits
        self._last_check = 0.0
        self._recheck = False  # a later measurement: the thread plan only, in free slots
        self._ratios: collections.deque[float] = collections.deque(maxlen=DRIFT_SAMPLES)
        self._others_busy: float | None = None  # other processes' busy cores before warm-up

    @property
    def executor(self) -> ThreadCalibration:  # valid where caps().thread_calibration
        return cast(ThreadCalibration, self.core.executor)

    @property
    def calibrates(self) -> bool:
        caps = self.core.caps
        return caps.thread_calibration and caps.threads_auto

    def identity(self) -> dict | None:
        """The cache key's fields; None when this executor's costs are not cached."""
        if not self.core.caps.thread_calibration:
            return None
        return {**cpu_identity(), **self.executor.cost_identity(), "threads_auto": self.calibrates}

    def _thread_plan(self) -> ThreadPlan | None:
        return self.executor.thread_plan if self.core.caps.thread_calibration else None

    @property
    def wide(self) -> Any:
        """The wide path's by-need state (executors/wide_lazy.py), or None."""
        return getattr(self.core.executor, "wide_lazy", None)

    @property
    def wide_status(self) -> str | None:
        return None if self.wide is None else self.wide.status

    def before_warmup(self) -> None:
        """Before the warm-up passes: the cached costs, else the safe thread count."""
        identity = self.identity()
        cached = load_cached(identity) if identity is not None else None
        if cached is not None and (cached[0] is not None or not self.calibrates):
            plan, self.core.idle_speed = cached
            if plan is not None and self.calibrates:
                self.executor.thread_plan = plan
                log.info("threads per pass width (cached): %s", plan.describe())
            self.status, self._recheck = "cached", True
        elif self.calibrates:
            others_busy = cpu_contention.SINCE_IMPORT.others_busy_cores()
            self.executor.thread_plan = unmeasured_plan(self.executor.n_threads, others_busy)
            self._others_busy = others_busy

    def at_warmup(self, background: bool) -> None:
        """After the warm-up: nothing (cached), or measure now, or mark them pending; the
        wide path's routing is decided now offline, by need while serving."""
        self._costs_at_warmup(background)
        if self.wide is not None and not background:
            self.wide.decide_now()

    def _costs_at_warmup(self, background: bool) -> None:
        if self.status == "cached":
            return
        if not background or self.identity() is None:
            self.measure()
            return
        self.pending, self.status = True, "measuring"
        self._recheck_at = time.monotonic() + FIRST_MEASURE_DELAY_S
        plan = self._thread_plan()
        log.info(
            "start costs not cached for this CPU, model and flags: serving now%s; measuring "
            "threads per pass width and idle TTFT in the background while idle (/ready shows "
            "progress)",
            f" on threads per pass width {plan.describe()}{self._busy_note()}" if plan else "",
        )

    def _busy_note(self) -> str:
        busy = self._others_busy
        return "" if busy is None else f" (other processes used {busy:.1f} of our cores)"

    def measure(
        self, should_stop: Callable[[], bool] = lambda: False, recheck: bool = False
    ) -> None:
        """Time the thread plan and the idle speed on the idle engine; cache them unless the
        plan was timed under contention. CalibrationInterrupted leaves everything as it was.
        The plan is timed in consecutive slots that hold nothing, so no conversation's cached
        prefix is lost to it; a first measurement that finds none drops the cached prefixes
        (a `recheck`, after a drift or contention, waits instead). The idle speed, timed
        through the scheduler, drops them too: it is timed once, not at a re-check."""
        armed = self.wide is not None and self.wide.armed
        if self.wide is not None:  # its made-up prompts are no need for the wide path
            self.wide.armed = False
        try:
            self._measure(should_stop, recheck)
        finally:
            if self.wide is not None:
                self.wide.armed = armed

    def _measure(self, should_stop: Callable[[], bool], recheck: bool) -> None:
        core, started_s = self.core, time.monotonic()
        plan = None
        if self.calibrates:
            self.status = "measuring threads per pass width"
            plan = self._calibrate(should_stop, recheck)
            core.reset_costs()  # the fit learns from passes on the new plan
        if should_stop():
            raise CalibrationInterrupted
        if not recheck or core.idle_speed is None:
            self.status = "measuring idle TTFT"

            def time_idle_speed() -> None:
                core.idle_speed = measure_idle_speed(core) or core.idle_speed

            core.measure_on_idle(time_idle_speed)
        speed = core.idle_speed
        log.info(
            "start costs measured in %.1f s: threads per pass width %s%s",
            time.monotonic() - started_s,
            f"{plan.describe()} {plan.timings_ms}" if plan else "as configured",
            f"; idle TTFT {speed.ttft_s * 1000:.1f} ms" if speed else "",
        )
        contended = plan is not None and plan.contended
        identity = self.identity()
        if identity is not None and not contended:
            store_cached(identity, plan, core.idle_speed)
        self.status = "contended" if contended else "measured"
        self._ratios.clear()
        self._last_check = time.monotonic()
        self._recheck = True  # from now on only the thread plan, in free slots
        if contended:
            self.pending, self._recheck_at = True, time.monotonic() + CONTENDED_RECHECK_S

    def _calibrate(self, should_stop: Callable[[], bool], recheck: bool) -> ThreadPlan:
        pool = self.core.pool
        free = [s.slot_id for s in pool.slots if s.owner is None and not s.hashes]
        calibrate = self.executor.calibrate_threads
        try:
            return calibrate(should_stop=should_stop, progress=self._progress, free_slots=free)
        except NoFreeSlots:
            if recheck:
                raise
        # first slots as scratch: the pool must first forget the prefixes they hold
        self.core.measure_on_idle(lambda: None)
        plan: ThreadPlan = calibrate(should_stop=should_stop, progress=self._progress)
        return plan

    def _progress(self, done: int, total: int) -> None:
        self.status = f"measuring threads per pass width ({done}/{total} widths)"

    def tick(self, should_stop: Callable[[], bool]) -> None:
        """Engine thread, engine idle: measure what is pending, giving way to arriving work."""
        if not self.pending or time.monotonic() < self._recheck_at:
            self._time_wide_path(should_stop)
            return
        self.pending = False
        try:
            self.measure(should_stop, recheck=self._recheck)
        except NoFreeSlots:  # a re-check: the slots hold conversations' prefixes
            self.pending, self.status = True, "re-measuring (waits for free slots)"
            self._recheck_at = time.monotonic() + NO_ROOM_RETRY_S
        except CalibrationInterrupted:
            self.pending, self.status = True, "measuring (paused for requests)"

    def wants_tick(self) -> bool:
        if self.wide is not None and self.wide.wants_time():
            return True
        return self.pending and time.monotonic() >= self._recheck_at

    def _time_wide_path(self, should_stop: Callable[[], bool]) -> None:
        """The wide path's routing, timed in a slot that holds nothing (wide_lazy.py)."""
        if self.wide is None or not self.wide.wants_time():
            return
        free = [s.slot_id for s in self.core.pool.slots if s.owner is None and not s.hashes]
        try:
            self.wide.time_now(free, should_stop)
        except CalibrationInterrupted:
            pass  # timed again at the next idle tick

    def observe(self, stats: StepStats | None) -> None:
        """After a step: a lone decode's time against the plan's; far off -> measure again."""
        plan = self._thread_plan()
        if stats is None or plan is None or self.pending or stats.num_seqs != 1:
            return
        if stats.num_tokens != 1 or stats.num_draft_tokens:
            return
        expected_ms = plan.expected_ms(1)
        if not expected_ms:
            return
        self._ratios.append(stats.execute_time_s * 1000 / expected_ms)
        if len(self._ratios) < DRIFT_SAMPLES:
            return
        ratio = statistics.median(self._ratios)
        self._ratios.clear()
        now = time.monotonic()
        drifted = ratio > DRIFT_FACTOR or ratio < 1 / DRIFT_FACTOR
        if drifted and now - self._last_check >= MIN_RECHECK_INTERVAL_S:
            log.info(
                "lone decodes take %.2fx the measured time: measuring the thread plan again "
                "in the background",
                ratio,
            )
            self.pending, self._recheck_at, self.status = True, now, "re-measuring (drift)"
