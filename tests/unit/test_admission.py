"""SLO admission: TTFT targets from the model's measured speed, and refusals only for the wait
the server's load adds (issue 17, part 9)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ultrafast.config import ServerConfig, TierTargets
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.engine.idle_speed import TYPICAL_PROMPT_TOKENS, measure_idle_speed
from ultrafast.engine.thread import EngineThread
from ultrafast.executors.fake_exec import FakeExecutor
from ultrafast.request import ServiceTier
from ultrafast.server.admission import Admission
from ultrafast.server.bridge import StepCostSnapshot
from ultrafast.server.errors import APIError

PRIORITY, DEFAULT = ServiceTier.PRIORITY, ServiceTier.DEFAULT
PRIORITY_RULE, DEFAULT_RULE = ServerConfig.priority, ServerConfig.default  # floors, factors
# the figures the tests below reason with, whatever the shipped defaults become
CONFIG = replace(
    ServerConfig(),
    priority=replace(
        ServerConfig.priority, ttft_ms=0.0, ttft_floor_ms=250.0, ttft_speed_factor=3.0
    ),
    default=replace(
        ServerConfig.default, ttft_ms=0.0, ttft_floor_ms=5000.0, ttft_speed_factor=20.0
    ),
)
# a slow model: 10 ms a step plus 2 ms a token (a 100-token prompt takes 210 ms alone)
SLOW = StepCostSnapshot(base_s=0.010, per_token_s=0.002, per_seq_s=0.001)


def admission(config=None, running=0, **speed) -> Admission:
    return Admission(
        config or CONFIG,
        step_costs=lambda: SLOW,
        num_running=lambda: running,
        **speed,
    )


def priority(adm: Admission, num_tokens: int, auto: bool = False):
    ticket = adm.reserve(PRIORITY, auto=auto)
    return adm.admit(ticket, num_tokens, auto)


def test_an_idle_server_admits_a_priority_prompt_whose_own_prefill_exceeds_the_target():
    adm = admission()  # nothing measured: the 250 ms floor
    assert adm.targets(PRIORITY).ttft_ms == 250.0
    ticket = priority(adm, 1000)  # 2.01 s of its own prefill
    assert ticket.tier == PRIORITY
    assert ticket.predicted_ttft_s == pytest.approx(SLOW.predict_s(1000))
    adm.release(ticket)
    assert adm.refused == {} and adm.in_flight[PRIORITY] == 0


def test_prefill_queued_ahead_that_makes_a_request_miss_its_target_is_refused():
    adm = admission()
    first = priority(adm, 100)  # its prefill has not produced a token yet
    with pytest.raises(APIError) as refused:
        priority(adm, 30)  # 70 ms alone, but 100 queued tokens add 200 ms: 270 > 250
    err = refused.value
    assert (err.status, err.code, err.param) == (429, "priority_slo_unattainable", "service_tier")
    assert "queued ahead" in err.message and "its own prefill" in err.message
    assert err.extra["queue_wait_ms"] == pytest.approx(200.0)
    assert err.extra["predicted_ttft_ms"] == pytest.approx(270.0)
    assert err.extra["target_ttft_ms"] == 250.0
    assert int(err.headers["Retry-After"]) >= 1
    assert adm.in_flight[PRIORITY] == 1 and adm.refused == {"slo_unattainable": 1}
    adm.first_token(first)  # the queue ahead is gone: the same request now fits
    adm.release(priority(adm, 30))


def test_running_sequences_add_their_share_of_each_step_to_the_wait():
    assert admission(running=0).queue_wait_s(PRIORITY) == 0.0
    busy = admission(running=100)  # 100 decodes share its steps: 100 x (2 + 1) ms
    assert busy.queue_wait_s(PRIORITY) == pytest.approx(0.3)
    with pytest.raises(APIError) as refused:
        priority(busy, 30)
    assert refused.value.extra["queue_wait_ms"] == pytest.approx(300.0)
    assert priority(admission(running=10), 30).tier == PRIORITY  # 30 + 70 ms: within 250


def test_a_refusal_never_reports_its_wait_as_zero():
    """A tiny model's queue adds tens of microseconds (one running decode of the demo model):
    against a target it cannot meet, the refusal's figures keep that wait visible (the e2e
    tier test once read `queue_wait_ms` 0.0 from a refusal rounded to 0.1 ms)."""
    tiny = StepCostSnapshot(base_s=0.0002, per_token_s=0.00003, per_seq_s=0.0)
    config = replace(CONFIG, priority=replace(CONFIG.priority, ttft_ms=0.001))
    adm = Admission(config, step_costs=lambda: tiny, num_running=lambda: 1)
    with pytest.raises(APIError) as refused:
        priority(adm, 4)
    extra = refused.value.extra
    assert extra["queue_wait_ms"] == pytest.approx(0.03)
    assert extra["predicted_ttft_ms"] > extra["queue_wait_ms"] > 0


def test_lower_tier_prefill_queued_is_not_ahead_of_a_priority_request():
    adm = admission()
    adm.admit(adm.reserve(DEFAULT), 2000, auto=False)  # a long default prompt waits
    assert adm.queue_wait_s(DEFAULT) == pytest.approx(4.0)
    assert adm.queue_wait_s(PRIORITY) == 0.0
    assert priority(adm, 100).tier == PRIORITY


def test_auto_drops_to_default_when_the_queue_would_make_priority_miss():
    adm = admission()
    priority(adm, 100)
    ticket = priority(adm, 30, auto=True)
    assert ticket.tier == DEFAULT and adm.in_flight[PRIORITY] == 1
    assert adm.refused == {}


def test_a_long_prompt_may_wait_what_a_typical_prompt_may():
    # typical prompt: 100 tokens, 210 ms alone; target 3x its idle TTFT = 630 ms
    adm = admission(typical_prompt_tokens=100, idle_ttft_s=0.21)
    assert adm.targets(PRIORITY).ttft_ms == pytest.approx(630.0)
    assert adm.allowed_wait_s(PRIORITY, SLOW.predict_s(100)) == pytest.approx(0.42)
    assert adm.allowed_wait_s(PRIORITY, SLOW.predict_s(5000)) == pytest.approx(0.42)
    ahead = priority(adm, 150)  # 300 ms queued ahead: within the 420 ms a typical one may wait
    assert priority(adm, 5000).tier == PRIORITY  # its own 10 s is not held against it
    adm.first_token(ahead)  # the 5000-token prefill is queued ahead now: 10 s
    for num_tokens in (50, 5000):
        with pytest.raises(APIError):
            priority(adm, num_tokens)


def test_auto_ttft_targets_follow_the_measured_idle_speed():
    adm = admission(ServerConfig(), typical_prompt_tokens=128, idle_ttft_s=0.5)
    targets = adm.describe_targets()
    for name, rule in (("priority", PRIORITY_RULE), ("default", DEFAULT_RULE)):
        assert rule.ttft_speed_factor * 500.0 > rule.ttft_floor_ms  # the speed decides
        assert targets[name]["ttft_ms"] == pytest.approx(rule.ttft_speed_factor * 500.0)
    assert {t["ttft_source"] for t in targets.values()} == {"measured"}
    assert targets["priority"]["itl_ms"] is None  # auto: the engine sizes it
    fast = admission(ServerConfig(), typical_prompt_tokens=128, idle_ttft_s=0.001)
    fast = fast.describe_targets()
    assert fast["priority"]["ttft_ms"] == PRIORITY_RULE.ttft_floor_ms
    assert fast["priority"]["ttft_source"] == "floor"
    assert fast["default"]["ttft_ms"] == DEFAULT_RULE.ttft_floor_ms
    unmeasured = admission(ServerConfig()).describe_targets()
    assert unmeasured["priority"]["ttft_source"] == "floor"


def test_an_idle_speed_measured_after_the_start_moves_the_auto_targets_only():
    """Start costs measured in the background (engine/start_costs.py): the server begins on
    the floors and follows the speed once it is in; a configured target stays."""
    config = replace(CONFIG, priority=replace(CONFIG.priority, ttft_ms=1000.0))
    adm = admission(config)
    assert adm.describe_targets()["default"]["ttft_source"] == "floor"
    adm.update_idle_speed(128, 0.5)
    targets = adm.describe_targets()
    assert targets["default"]["ttft_source"] == "measured"
    assert targets["default"]["ttft_ms"] == pytest.approx(20.0 * 500.0)  # CONFIG's factor
    assert targets["priority"]["ttft_ms"] == 1000.0
    assert targets["priority"]["ttft_source"] == "configured"
    assert adm.typical_prompt_tokens == 128 and adm.idle_ttft_s == 0.5


def test_an_explicit_target_wins_over_the_measured_speed():
    config = replace(CONFIG, priority=replace(CONFIG.priority, ttft_ms=1000.0))
    adm = admission(config, typical_prompt_tokens=100, idle_ttft_s=2.0)
    assert adm.targets(PRIORITY).ttft_ms == 1000.0
    assert adm.describe_targets()["priority"]["ttft_source"] == "configured"
    assert adm.targets(DEFAULT).ttft_ms == pytest.approx(40000.0)  # still auto
    ahead = priority(adm, 390)  # 780 ms queued ahead; 100 tokens alone: 210 ms -> 990 ms
    assert priority(adm, 100).tier == PRIORITY
    adm.first_token(ahead)
    priority(adm, 400)  # ahead now: the 100 above + 400 = 1000 ms, past the 790 ms allowed
    with pytest.raises(APIError) as refused:
        priority(adm, 100)
    assert refused.value.extra["target_ttft_ms"] == 1000.0


def test_tier_targets_resolve_and_validate():
    auto = TierTargets(0.0, 0.0, 8, ttft_floor_ms=100.0, ttft_speed_factor=4.0)
    assert auto.ttft_auto and auto.resolved(None).ttft_ms == 100.0
    assert auto.resolved(0.2).ttft_ms == pytest.approx(800.0)
    assert not auto.resolved(0.2).ttft_auto
    explicit = replace(auto, ttft_ms=50.0)
    assert explicit.resolved(10.0) is explicit
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="ttft_ms"):
            TierTargets(bad, 0.0, 8)
    with pytest.raises(ValueError, match="ttft_speed_factor"):
        TierTargets(0.0, 0.0, 8, ttft_speed_factor=-2.0)


def test_the_cli_keeps_each_tiers_floor_and_rejects_a_negative_target():
    from ultrafast.cli import parse_args
    from ultrafast.cli_serve import server_config

    args = parse_args(["serve", "m", "--priority-ttft-ms", "0"])
    assert server_config(args).priority == ServerConfig.priority
    args = parse_args(["serve", "m", "--priority-ttft-ms", "-5"])
    with pytest.raises(ValueError, match="ttft_ms"):
        server_config(args)


# ---- the measurement at start (engine/idle_speed.py) ---------------------------------------


def fake_core(step_s: float, max_model_len: int = 256) -> EngineCore:
    executor = FakeExecutor(num_slots=2, max_model_len=max_model_len, step_s=step_s)
    return EngineCore(executor, SchedulerConfig(max_num_seqs=2, max_model_len=max_model_len))


def test_the_idle_speed_is_timed_on_a_warm_engine_that_is_left_clean():
    core = fake_core(step_s=0.02)
    core.warmup()
    speed = core.idle_speed
    assert speed is not None and speed.prompt_tokens == TYPICAL_PROMPT_TOKENS
    assert speed.ttft_s >= 0.02 and speed.decode_s is not None and speed.decode_s >= 0.02
    assert not core.has_work() and core.pool.num_running == 0
    assert all(not s.hashes for s in core.pool.slots)  # no measured prompt left to match
    assert core.costs.single_decode_s is not None  # the timed steps seed the step-cost fit


def test_a_short_context_times_a_shorter_prompt_and_a_failing_step_measures_nothing():
    assert measure_idle_speed(fake_core(0.0, max_model_len=40)).prompt_tokens == 40 - 5
    core = fake_core(0.0)

    def fail(plan):
        raise RuntimeError("device lost")

    core.executor.execute = fail
    assert measure_idle_speed(core) is None
    assert not core.has_work()


def test_a_slower_engine_gets_a_looser_priority_target():
    engine = EngineThread(fake_core(step_s=0.1)).start(warmup=True)
    try:
        speed = engine.snapshot().idle_speed
        assert speed is not None and speed.ttft_s >= 0.1
        adm = Admission(
            ServerConfig(),
            step_costs=lambda: engine.snapshot().step_costs,
            typical_prompt_tokens=speed.prompt_tokens,
            idle_ttft_s=speed.ttft_s,
        )
        assert adm.targets(PRIORITY).ttft_ms == pytest.approx(3000 * speed.ttft_s)
        assert adm.targets(PRIORITY).ttft_ms > ServerConfig.priority.ttft_floor_ms
        # the engine is idle: a prompt far longer than the target's worth is admitted
        assert priority(adm, 4000).tier == PRIORITY
    finally:
        engine.stop()


def test_default_tier_queues_a_burst_then_refuses_only_on_predicted_wait():
    """No fixed queue count: a burst far past the old 64 waits, until the work queued ahead
    would make the next call's first token later than the tier's 5 s target (CONFIG)."""
    adm = admission()  # auto in-flight limit (DEFAULT_AUTO_IN_FLIGHT without a memory figure)
    assert adm.targets(DEFAULT).max_in_flight == 1024
    admitted = []
    with pytest.raises(APIError) as refused:
        for _ in range(200):  # 100 tokens each: 0.2 s of prefill apiece at SLOW's rates
            admitted.append(adm.admit(adm.reserve(DEFAULT), 100, auto=False))
    err = refused.value
    assert (err.status, err.code, err.param) == (429, "wait_over_target", "service_tier")
    assert "predicted wait" in err.message and "5 s target" in err.message
    assert int(err.headers["Retry-After"]) >= 1
    # 0.2 s a call: about 5 s / 0.2 s = 25 queued calls fit under the target, then refusal
    assert 20 <= len(admitted) <= 26
    assert adm.in_flight[DEFAULT] == len(admitted) and adm.refused == {"wait_over_target": 1}
    for ticket in admitted:  # first tokens came out: the queue ahead is gone
        adm.release(ticket)
    adm.release(adm.admit(adm.reserve(DEFAULT), 100, auto=False))


def test_the_in_flight_count_is_sized_from_memory_and_says_so_when_full():
    from ultrafast.server.admission import auto_in_flight

    gib = 1024**3
    assert auto_in_flight(None, 2048, 4096) == 1024
    assert auto_in_flight(24 * gib, 2048, 4096) == 2048  # half the engine's queue
    assert auto_in_flight(1 * gib, 2048, 4096) == 256  # 1/32 of 1 GiB / (64 B x 2048)
    assert auto_in_flight(1024, 2048, 4096) == 1
    adm = admission(auto_in_flight_limit=2)
    tickets = [adm.reserve(DEFAULT), adm.reserve(DEFAULT)]
    with pytest.raises(APIError) as full:
        adm.reserve(DEFAULT)
    err = full.value
    assert (err.status, err.code) == (503, "queue_full")
    assert "2 calls in flight" in err.message and "memory" in err.message
    assert adm.describe_targets()["default"]["max_in_flight_source"] == "memory"
    explicit = admission(replace(CONFIG, default=replace(CONFIG.default, max_in_flight=1)))
    explicit.reserve(DEFAULT)
    with pytest.raises(APIError) as configured:
        explicit.reserve(DEFAULT)
    assert "configured limit" in configured.value.message
    for ticket in tickets:
        adm.release(ticket)


def test_a_wait_refusal_names_the_wait_the_target_leaves_not_the_target_alone():
    """A 1 s queue refused because a long prompt's own prefill leaves little of the 5 s
    target must say so, not that 1 s 'exceeds its 5 s target' (issue 29 item 5)."""
    adm = admission(typical_prompt_tokens=2300)  # own prefill ~4.6 s at SLOW's rates
    admitted = []
    with pytest.raises(APIError) as refused:
        for _ in range(50):
            admitted.append(adm.admit(adm.reserve(DEFAULT), 2300, auto=False))
    message = refused.value.message
    wait_s = adm.queue_wait_s(DEFAULT)
    allowed_s = adm.allowed_wait_s(DEFAULT, adm.own_prefill_s(2300))
    assert wait_s < 5 and allowed_s < wait_s
    assert f"~{allowed_s * 1000:.0f} ms" in message and "5 s target" in message
    assert "exceeds" not in message
    for ticket in admitted:
        adm.release(ticket)
