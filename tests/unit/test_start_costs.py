"""Start costs (engine/start_costs.py): the thread plan and idle speed come from the cache
per (CPU, model file, flags); with nothing cached they are measured in the background, giving
way to requests; a contended plan is never cached; drifting step times measure again."""

from types import SimpleNamespace

import pytest

from ultrafast import cpu_contention
from ultrafast.engine import start_costs
from ultrafast.engine.idle_speed import IdleSpeed
from ultrafast.engine.start_costs import StartCosts
from ultrafast.executors import cost_cache
from ultrafast.executors.base import ExecutorCaps
from ultrafast.executors.ggml_threads import CalibrationInterrupted, NoFreeSlots, ThreadPlan

QUIET = ThreadPlan((1, 16), (1, 2), ((24.0, 30.0), (90.0, 50.0)), (1, 2))
SPEED = IdleSpeed(prompt_tokens=128, ttft_s=0.05, decode_s=0.02)


class FakeExecutor:
    threads_auto = True
    n_threads = 2

    def caps(self):
        return ExecutorCaps(thread_calibration=True, threads_auto=self.threads_auto)

    def __init__(self, model, plan=QUIET):
        self.model, self.plan, self.thread_plan, self.calibrations = model, plan, None, 0

    def cost_identity(self):
        stat = self.model.stat()
        return {"model": str(self.model), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def calibrate_threads(self, should_stop=lambda: False, free_slots=None, progress=None):
        self.calibrations += 1
        self.scratch_held = [s.hashes for s in self.pool.slots if s.hashes]
        if progress is not None:
            progress(1, 2)
        self.free_slots = free_slots
        if free_slots is not None and len(free_slots) < 2:
            raise NoFreeSlots("no room")
        if should_stop():
            raise CalibrationInterrupted
        self.thread_plan = self.plan
        return self.plan


class FakeCore:
    def __init__(self, executor):
        self.executor, self.idle_speed, self.cost_resets = executor, None, 0
        self.caps = executor.caps()
        self.pool = executor.pool = SimpleNamespace(
            slots=[SimpleNamespace(slot_id=i, owner=None, hashes=[]) for i in range(3)]
        )
        self.pool_resets = 0

    def measure_on_idle(self, measure):
        self.pool_resets += 1  # as EngineCore: the slots' cached prefixes are dropped first
        for slot in self.pool.slots:
            if slot.owner is None:
                slot.hashes = []
        measure()

    def reset_costs(self):
        self.cost_resets += 1


class QuietMachine:
    busy: float | None = 0.0  # other processes' busy cores (cpu_contention.py)

    def others_busy_cores(self):
        return self.busy


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_contention, "SINCE_IMPORT", QuietMachine())
    monkeypatch.setattr(start_costs, "FIRST_MEASURE_DELAY_S", 0.0)  # (tested on its own)
    monkeypatch.setattr(start_costs, "measure_idle_speed", lambda core: SPEED)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"weights")
    return path


def _start(costs, background):
    costs.before_warmup()  # as EngineCore.warmup: around its warm-up passes
    costs.at_warmup(background)


# until measured: a one-token pass on every core but one of FakeExecutor's two, any wider one
# (a prompt's prefill) on both
SAFE = ThreadPlan((1, 2), (1, 2))


def _costs(model, plan=QUIET):
    core = FakeCore(FakeExecutor(model, plan))
    return core, StartCosts(core)


def test_nothing_cached_serves_at_once_and_measures_when_idle_then_the_next_start_reuses(model):
    core, costs = _costs(model)
    _start(costs, background=True)
    assert core.executor.calibrations == 0 and costs.pending and costs.status == "measuring"
    assert core.executor.thread_plan == SAFE
    assert (SAFE.for_tokens(1), SAFE.for_tokens(37)) == (1, 2)  # a cold start's first prompt
    costs.tick(lambda: False)
    assert core.executor.thread_plan == QUIET and core.idle_speed == SPEED
    assert costs.status == "measured" and not costs.pending and core.cost_resets == 1
    assert cost_cache.cache_path(costs.identity()).is_file()

    again, costs2 = _costs(model)
    _start(costs2, background=True)
    assert again.executor.calibrations == 0 and costs2.status == "cached"
    assert again.executor.thread_plan == QUIET and again.idle_speed == SPEED


def test_the_first_measurement_waits_for_a_request_that_comes_at_once(model, monkeypatch):
    monkeypatch.setattr(start_costs, "FIRST_MEASURE_DELAY_S", 60.0)
    core, costs = _costs(model)
    _start(costs, background=True)
    assert costs.pending and not costs.wants_tick()  # idle, but only just warmed up
    costs.tick(lambda: False)
    assert core.executor.calibrations == 0 and core.executor.thread_plan == SAFE
    costs._recheck_at -= 60.0  # the delay has passed
    assert costs.wants_tick()
    costs.tick(lambda: False)
    assert core.executor.thread_plan == QUIET and costs.status == "measured"


@pytest.mark.parametrize("busy", [0.9, 1.5])
def test_a_busy_machine_serves_every_pass_on_every_core_but_one_until_measured(model, busy):
    cpu_contention.SINCE_IMPORT.busy = busy
    core, costs = _costs(model)
    _start(costs, background=True)
    assert core.executor.thread_plan == ThreadPlan((1,), (1,))  # a prefill too: no barriers
    assert costs.pending  # measured when idle, as on a quiet machine


def test_unknown_contention_keeps_llama_cpp_s_default_for_wide_passes(model):
    cpu_contention.SINCE_IMPORT.busy = None  # no /proc, or too short a window
    core, costs = _costs(model)
    _start(costs, background=True)
    assert core.executor.thread_plan == SAFE


def test_a_changed_model_file_is_measured_again(model):
    core, costs = _costs(model)
    _start(costs, background=False)  # offline: measured at once
    assert core.executor.calibrations == 1 and costs.status == "measured"
    model.write_bytes(b"other weights")
    core2, costs2 = _costs(model)
    _start(costs2, background=True)
    assert costs2.pending and core2.executor.thread_plan == SAFE


def test_a_request_interrupts_the_measurement_and_it_resumes_later(model):
    core, costs = _costs(model)
    _start(costs, background=True)
    costs.tick(lambda: True)  # work waiting
    assert costs.pending and "paused" in costs.status and core.executor.thread_plan == SAFE
    assert not cost_cache.cache_path(costs.identity()).exists()
    costs.tick(lambda: False)
    assert costs.status == "measured" and core.executor.thread_plan == QUIET


def test_a_contended_plan_is_used_but_not_cached_and_measured_again_later(model):
    contended = ThreadPlan((1,), (1,), ((24.0, 1885.0),), (1, 2), contended=True)
    core, costs = _costs(model, contended)
    _start(costs, background=True)
    costs.tick(lambda: False)
    assert core.executor.thread_plan == contended and costs.status == "contended"
    assert not cost_cache.cache_path(costs.identity()).exists()
    assert costs.pending and not costs.wants_tick()  # after CONTENDED_RECHECK_S


def test_lone_decodes_far_slower_than_measured_trigger_a_background_recheck(model, monkeypatch):
    monkeypatch.setattr(start_costs, "MIN_RECHECK_INTERVAL_S", 0.0)
    core, costs = _costs(model)
    _start(costs, background=False)
    lone = SimpleNamespace(num_seqs=1, num_tokens=1, num_draft_tokens=0, execute_time_s=0.024)
    for _ in range(start_costs.DRIFT_SAMPLES):
        costs.observe(lone)  # as measured: nothing to do
    assert not costs.pending
    slow = SimpleNamespace(num_seqs=1, num_tokens=1, num_draft_tokens=0, execute_time_s=0.1)
    wide = SimpleNamespace(num_seqs=8, num_tokens=8, num_draft_tokens=0, execute_time_s=9.0)
    for _ in range(start_costs.DRIFT_SAMPLES - 1):
        costs.observe(slow)
        costs.observe(wide)  # only lone decodes are compared
    assert not costs.pending
    costs.observe(slow)
    assert costs.pending and costs.wants_tick() and "drift" in costs.status
    speeds = []
    monkeypatch.setattr(start_costs, "measure_idle_speed", lambda core: speeds.append(1))
    resets = core.pool_resets
    core.pool.slots[0].hashes = [b"a conversation's prefix"]
    core.pool.slots[2].owner = "a running request"
    costs.tick(lambda: False)
    assert core.executor.calibrations == 2 and core.executor.free_slots == [1]
    assert costs.pending and not costs.wants_tick()  # no room: later, nothing dropped
    assert core.pool.slots[0].hashes and core.pool_resets == resets
    core.pool.slots[2].owner = None
    monkeypatch.setattr(start_costs, "NO_ROOM_RETRY_S", 0.0)
    costs._recheck_at = 0.0
    costs.tick(lambda: False)
    assert core.executor.free_slots == [1, 2] and costs.status == "measured"
    assert not speeds and core.pool_resets == resets  # the plan only: the idle speed stays


def test_an_unreadable_or_foreign_cache_file_is_a_miss(model):
    core, costs = _costs(model)
    path = cost_cache.cache_path(costs.identity())
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert start_costs.load_cached(costs.identity()) is None
    path.write_text('{"identity": {"model": "another"}, "thread_plan": null}')
    assert start_costs.load_cached(costs.identity()) is None


def test_a_first_measurement_without_free_slots_drops_the_cached_prefixes_before_timing(model):
    """The plan's passes overwrite their scratch slots: the pool must forget what those slots
    held first, or a later request would reuse KV that is gone."""
    core, costs = _costs(model)
    _start(costs, background=True)
    for slot in core.pool.slots[:2]:
        slot.hashes = [b"a cached prefix"]
    costs.tick(lambda: False)
    assert core.executor.free_slots is None  # the fallback: the first slots
    assert core.executor.scratch_held == [] and costs.status == "measured"


class FakeWide:
    """The wide path's by-need state as StartCosts sees it (executors/wide_lazy.py)."""

    def __init__(self, untimed=True, interrupt=False):
        self.armed, self.untimed, self.interrupt = True, untimed, interrupt
        self.status, self.decided_now, self.timed_in = "by need", 0, []
        self.armed_while_measured: list[bool] = []

    def wants_time(self):
        return self.untimed

    def time_now(self, free_slots, should_stop):
        if self.interrupt:
            raise CalibrationInterrupted
        self.timed_in.append(free_slots)
        self.untimed = False
        return True

    def decide_now(self):
        self.decided_now += 1


def test_the_wide_path_is_unarmed_by_made_up_prompts_and_timed_on_an_idle_tick(model, monkeypatch):
    core, costs = _costs(model)
    wide = core.executor.wide_lazy = FakeWide()
    seen = []
    monkeypatch.setattr(start_costs, "measure_idle_speed", lambda c: seen.append(wide.armed))
    _start(costs, background=True)
    assert wide.armed and not wide.decided_now and costs.wide_status == "by need"
    assert costs.wants_tick()
    costs.tick(lambda: False)  # the thread plan first, the idle speed unarmed
    assert seen == [False] and wide.armed and not wide.timed_in
    core.pool.slots[1].hashes = ["a conversation's prefix"]
    costs.tick(lambda: False)  # then the wide path, in slots that hold nothing
    assert wide.timed_in == [[0, 2]] and not costs.wants_tick()


def test_an_interrupted_wide_timing_waits_for_the_next_idle_tick(model):
    core, costs = _costs(model)
    wide = core.executor.wide_lazy = FakeWide(interrupt=True)
    _start(costs, background=True)
    costs.tick(lambda: False)  # thread plan and idle speed
    costs.tick(lambda: True)  # the wide timing gives way to a request
    assert costs.wants_tick() and wide.untimed


def test_offline_the_wide_path_is_decided_at_warmup(model, seen_armed):
    core, costs = _costs(model)
    wide = core.executor.wide_lazy = FakeWide()
    _start(costs, background=False)
    assert wide.decided_now == 1 and wide.armed
    assert seen_armed == [False]  # its own idle-speed prompts were no need


@pytest.fixture
def seen_armed(monkeypatch):
    seen: list[bool] = []

    def measure(core):
        seen.append(core.executor.wide_lazy.armed)
        return SPEED

    monkeypatch.setattr(start_costs, "measure_idle_speed", measure)
    return seen
