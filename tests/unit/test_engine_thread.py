"""EngineThread: outputs reach callbacks, aborts free slots, the shaper coalesces arrivals."""

import dataclasses
import threading
import time

import pytest

from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.engine.step_costs import StepCostModel
from ultrafast.engine.thread import EngineThread
from ultrafast.executors.fake_exec import FakeExecutor, reference_tokens
from ultrafast.request import Request, SamplingParams, ServiceTier


def start_engine(shaper_window_s=0.0, num_slots=4):
    executor = FakeExecutor(num_slots=num_slots, step_s=0.002)
    core = EngineCore(executor, SchedulerConfig(max_num_seqs=num_slots, max_model_len=256))
    return EngineThread(core, shaper_window_s=shaper_window_s).start(), executor


class Collector:
    def __init__(self):
        self.tokens, self.finish, self.done = [], None, threading.Event()

    def __call__(self, out):
        self.tokens.extend(out.new_token_ids)
        if out.finished:
            self.finish = out.finish_reason
            self.done.set()


def test_outputs_arrive_and_match_reference():
    engine, _ = start_engine()
    collectors = {}
    for i in range(3):
        c = collectors[i] = Collector()
        engine.submit(
            Request(f"r{i}", [i + 1, 2, 3], SamplingParams(temperature=0, max_tokens=8)), c
        )
    for i, c in collectors.items():
        assert c.done.wait(5)
        assert c.tokens == reference_tokens([i + 1, 2, 3], 8)
    engine.stop()


def test_abort_from_another_thread_frees_the_slot():
    engine, _ = start_engine()
    c = Collector()
    engine.submit(
        Request("long", [1, 2], SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)),
        c,
    )
    time.sleep(0.05)
    engine.abort("long")
    assert c.done.wait(5) and c.finish == "abort"
    wait_for(lambda: engine.core.pool.num_running == 0)  # not a fixed sleep: load stretches it
    engine.stop()


def test_bad_request_gets_an_error_output_not_a_dead_engine():
    engine, _ = start_engine()
    c = Collector()
    engine.submit(Request("bad", [10_000], SamplingParams(max_tokens=2)), c)
    assert c.done.wait(5) and c.finish == "error"
    ok = Collector()
    engine.submit(Request("ok", [1], SamplingParams(temperature=0, max_tokens=2)), ok)
    assert ok.done.wait(5) and ok.finish == "length" and engine.alive
    engine.stop()


def test_shaper_puts_a_burst_of_default_arrivals_into_one_step():
    # the window is 50 times the arrivals' spread: a loaded machine's late wake-ups fit in it
    engine, executor = start_engine(shaper_window_s=1.0)
    collectors = [Collector() for _ in range(3)]
    for i, c in enumerate(collectors):
        engine.submit(Request(f"b{i}", [i + 1], SamplingParams(temperature=0, max_tokens=1)), c)
        time.sleep(0.01)
    assert all(c.done.wait(5) for c in collectors)
    assert len(executor.plans[0].seqs) == 3
    engine.stop()


def test_priority_arrival_skips_the_shaper_wait():
    # a window no test outlasts: the answer coming at all shows it was not waited for (no
    # elapsed-time bound, which a loaded machine could break)
    engine, executor = start_engine(shaper_window_s=3600.0)
    c = Collector()
    engine.submit(
        Request("p", [1], SamplingParams(temperature=0, max_tokens=1), tier=ServiceTier.PRIORITY), c
    )
    assert c.done.wait(60)
    engine.stop()


def test_step_cost_model_fits_base_and_per_token_cost():
    costs = StepCostModel()
    for n in (1, 4, 16, 64, 2, 32):
        costs.observe(num_seqs=1, num_tokens=n, elapsed_s=0.010 + 0.0005 * n)
    assert abs(costs.base_s - 0.010) < 1e-6 and abs(costs.per_token_s - 0.0005) < 1e-8
    assert costs.token_budget(0.050) == 80
    assert abs(costs.auto_itl_target_s() - 1.2 * 0.0105) < 1e-9


def test_step_cost_model_fits_a_sequence_apart_from_a_token():
    costs = StepCostModel()
    for seqs, tokens in ((1, 1), (1, 20), (3, 3), (1, 6), (4, 4), (2, 2), (4, 24), (1, 1)):
        costs.observe(seqs, tokens, 0.001 + 0.0008 * (seqs - 1) + 0.0002 * tokens)
    assert abs(costs.per_seq_s - 0.0008) < 1e-7 and abs(costs.per_token_s - 0.0002) < 1e-8
    assert abs(costs.base_s - 0.001) < 1e-7
    # each extra token may be a decode of its own: 1.2 ms + 2 x 1 ms fits 3 tokens, not 4
    assert costs.token_budget(0.0032 + 1e-6) == 3


def test_auto_itl_target_comes_from_the_fitted_lone_decode_not_a_noisy_reading():
    costs = StepCostModel()
    assert costs.auto_itl_target_s() is None  # nothing measured yet
    costs.observe(1, 1, 0.0015)  # before a fit, the measured lone decode is all there is
    assert abs(costs.auto_itl_target_s() - 1.2 * 0.0015) < 1e-9
    # lone decodes read slow (a longer context, another thread on the core) against a
    # line of 0.8 ms + 0.4 ms per token fitted over every step
    for n in (8, 1, 16, 2, 1, 4, 8, 1):
        costs.observe(1, n, 0.0016 if n == 1 else 0.0008 + 0.0004 * n)
    target = costs.auto_itl_target_s()
    assert target == pytest.approx(1.2 * (costs.base_s + costs.per_token_s))
    # a second sequence costs a third of a step: not let into a priority step
    assert costs.token_budget(target) == 1


def test_engine_thread_warms_up_on_its_own_thread_before_start_returns():
    # llama.cpp's OpenMP threads only speed up passes run from the thread that ran the first
    executor = FakeExecutor(num_slots=2)
    threads = []
    execute = executor.execute
    executor.execute = lambda plan: threads.append(threading.current_thread().name) or execute(plan)
    engine = EngineThread(EngineCore(executor, SchedulerConfig(max_num_seqs=2, max_model_len=64)))
    engine.start(warmup=True)
    try:
        assert threads and set(threads) == {"ultrafast-engine"}  # done before start returned
        assert not engine.core.has_work() and engine.core.pool.num_running == 0
        c = Collector()
        engine.submit(Request("r", [1, 2], SamplingParams(temperature=0, max_tokens=2)), c)
        assert c.done.wait(5) and c.tokens == reference_tokens([1, 2], 2)
    finally:
        engine.stop()


@pytest.mark.parametrize("measure_speed", [True, False])
def test_warmup_times_the_idle_speed_only_when_asked(measure_speed):
    # a model reloaded by the residency cache warms up without timing its speed again
    executor = FakeExecutor(num_slots=2, step_s=0.001)
    engine = EngineThread(EngineCore(executor, SchedulerConfig(max_num_seqs=2, max_model_len=256)))
    engine.start(warmup=True, measure_speed=measure_speed)
    try:
        assert executor.plans  # warmed up either way
        assert (engine.snapshot().idle_speed is not None) == measure_speed
    finally:
        engine.stop()


def test_warmup_leaves_the_engine_clean():
    executor = FakeExecutor(num_slots=2)
    core = EngineCore(executor, SchedulerConfig(max_num_seqs=2, max_model_len=64))
    core.warmup()
    assert executor.plans and not core.has_work() and core.pool.num_running == 0
    assert all(not s.hashes for s in core.pool.slots)  # no fake prefix left to match


# ---- the read API the server uses (through server/bridge.py) --------------------------------


def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_snapshot_is_published_after_steps_and_counts_the_finished_work():
    engine, _ = start_engine(num_slots=4)
    try:
        before = engine.snapshot()
        assert before.num_kv_slots_total == 4 and before.max_model_len == 256
        assert before.num_running == 0 and before.device_kind == "cpu"
        assert not before.step_costs.measured
        c = Collector()
        engine.submit(Request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6)), c)
        assert c.done.wait(5)
        snap = engine.snapshot()  # published before the finish was delivered
        assert snap.step_id > before.step_id and snap.num_running == 0
        # every prompt token but the last was looked up in the prefix cache
        assert snap.num_prefix_queries == 1 and snap.num_prefix_query_tokens == 2
        assert snap.num_draft_tokens == {}  # no speculation: empty, SpeculationStats' names
        with pytest.raises(dataclasses.FrozenInstanceError):
            snap.num_kv_slots_total = 1  # frozen: readers share nothing mutable
    finally:
        engine.stop()


def test_snapshot_shows_a_running_request_and_its_tier():
    engine, _ = start_engine(num_slots=2)
    try:
        c = Collector()
        engine.submit(
            Request(
                "long",
                [1, 2],
                SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True),
                tier=ServiceTier.PRIORITY,
            ),
            c,
        )
        wait_for(lambda: engine.snapshot().num_running_by_tier[ServiceTier.PRIORITY] == 1)
        assert engine.snapshot().num_kv_slots_running == 1
        engine.abort("long")
        assert c.done.wait(5)
        wait_for(lambda: engine.snapshot().num_running == 0)
    finally:
        engine.stop()


def test_step_cost_snapshot_predicts_from_the_fit_or_the_fallback():
    from ultrafast.engine.read_api import StepCostSnapshot

    assert StepCostSnapshot().predict_s(10, fallback=(0.01, 0.002)) == pytest.approx(0.03)
    costs = StepCostModel()
    for n in (1, 4, 16, 64, 2, 32):
        costs.observe(num_seqs=1, num_tokens=n, elapsed_s=0.010 + 0.0005 * n)
    snap = StepCostSnapshot.of(costs)
    assert snap.measured and snap.predict_s(100) == pytest.approx(0.010 + 0.05)
    costs.observe(1, 8, 5.0)  # the live model moves on; the snapshot does not
    assert snap.predict_s(100) == pytest.approx(0.060)


def test_cached_prefix_tokens_sees_a_finished_prompt_per_tenant():
    engine, _ = start_engine(num_slots=2)
    try:
        prompt = list(range(1, 70))
        c = Collector()
        engine.submit(
            Request("a", prompt, SamplingParams(temperature=0, max_tokens=2), tenant="acme"), c
        )
        assert c.done.wait(5)
        wait_for(lambda: engine.snapshot().num_running == 0)
        assert engine.cached_prefix_tokens(prompt + [5, 6], "acme") >= 64
        assert engine.cached_prefix_tokens(prompt + [5, 6], "beta") == 0  # never across tenants
    finally:
        engine.stop()


def test_configure_applies_on_the_engine_thread_before_the_next_step():
    from ultrafast.engine.read_api import EngineSettings

    engine, _ = start_engine(num_slots=2)
    try:
        applied_on = []
        apply = engine._apply_settings
        engine._apply_settings = lambda s: (
            applied_on.append(threading.current_thread().name) or apply(s)
        )
        engine.configure(EngineSettings(reserved_priority_seats={"acme": 1}))
        c = Collector()
        engine.submit(Request("r", [1], SamplingParams(temperature=0, max_tokens=1)), c)
        assert c.done.wait(5)
        assert applied_on == ["ultrafast-engine"]
        assert engine.core.scheduler.reserved_priority_seats == {"acme": 1}
    finally:
        engine.stop()
