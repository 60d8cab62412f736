"""Short requests first within the default and flex tiers (SchedulerConfig.short_first_window_s)."""

import time

from tests.unit.engine_driver import prompt, run_all
from ultrafast.core.kv_pool import KVSlotPool
from ultrafast.core.scheduler import LASTING_DECODES, Scheduler, SchedulerConfig
from ultrafast.core.types import StepResult
from ultrafast.engine.core import EngineCore
from ultrafast.engine.step_costs import StepCostModel
from ultrafast.executors.fake_exec import FakeExecutor, reference_tokens
from ultrafast.request import Request, SamplingParams, ServiceTier

DECODE_S = 0.05  # the made-up cost of one output token in these tests


def work_s(request: Request) -> float:
    return request.sampling_params.max_tokens * DECODE_S


def make(window_s: float, num_slots: int = 8, budget: int = 4) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=num_slots,
        max_model_len=64,
        max_num_batched_tokens=budget,
        max_prefill_chunk_tokens=budget,
        short_first_window_s=window_s,
    )
    return Scheduler(config, KVSlotPool(num_slots), work_s)


def request(rid, max_tokens, arrival_s, tier=ServiceTier.DEFAULT, num_prompt=4):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, prompt(len(rid), num_prompt), params, tier=tier, arrival_time_s=arrival_s)


def prefill_order(sched: Scheduler) -> list[str]:
    """Request ids in the order their prefills end (one 4-token prompt per step)."""
    order = []
    while sched.has_work():
        plan = sched.schedule()
        done = {s.request_id: [1] for s in plan.seqs if s.num_logits}
        order += [s.request_id for s in plan.seqs if s.num_logits and s.request_id not in order]
        sched.update(plan, StepResult(sampled_token_ids=done))
    return order


def test_in_a_burst_short_requests_prefill_before_long_ones_that_came_first():
    sched = make(window_s=2.0)
    sched.add_request(request("long-a", 64, arrival_s=10.0))
    sched.add_request(request("long-b", 64, arrival_s=10.1))
    for i in range(3):
        sched.add_request(request(f"short-{i}", 1, arrival_s=10.2 + i / 10))
    assert prefill_order(sched) == ["short-0", "short-1", "short-2", "long-a", "long-b"]


def test_first_come_first_served_without_the_window():
    sched = make(window_s=0.0)
    sched.add_request(request("long-a", 64, arrival_s=10.0))
    sched.add_request(request("short-0", 1, arrival_s=10.2))
    assert prefill_order(sched) == ["long-a", "short-0"]


def test_a_long_request_is_overtaken_only_within_the_window():
    sched = make(window_s=1.0)  # long-a's 3.2 s of work counts as 1 s
    sched.add_request(request("long-a", 64, arrival_s=10.0))
    sched.add_request(request("short-late", 1, arrival_s=11.5))  # 1.5 s later: behind it
    sched.add_request(request("short-soon", 1, arrival_s=10.5))
    assert prefill_order(sched) == ["short-soon", "long-a", "short-late"]


def test_priority_requests_stay_first_come_first_served():
    sched = make(window_s=2.0)
    sched.add_request(request("p-long", 64, 10.0, ServiceTier.PRIORITY))
    sched.add_request(request("p-short", 1, 10.1, ServiceTier.PRIORITY))
    assert prefill_order(sched) == ["p-long", "p-short"]


def test_running_prefills_are_ordered_the_same_way():
    """Once both are part way through their prompts, the short one's chunks go first."""
    sched = make(window_s=2.0, budget=6)
    chunked = {**sched.config.__dict__, "max_prefill_chunk_tokens": 3}
    sched.config = SchedulerConfig(**chunked)
    sched.add_request(request("long-a", 64, arrival_s=10.0, num_prompt=12))
    plan = sched.schedule()
    sched.update(plan, StepResult())
    sched.add_request(request("short-0", 1, arrival_s=10.1, num_prompt=12))
    plan = sched.schedule()  # long-a's running prefill, then short-0 starts
    assert [(s.request_id, len(s.token_ids)) for s in plan.seqs] == [("long-a", 3), ("short-0", 3)]
    sched.update(plan, StepResult())
    sched.config = SchedulerConfig(**{**chunked, "max_num_batched_tokens": 3})
    plan = sched.schedule()  # room for one chunk: the short request's
    assert [s.request_id for s in plan.seqs] == ["short-0"]


def fixed_costs(decode_s: float, per_token_s: float) -> StepCostModel:
    """A cost model fed made-up step times (lone decodes and 8-token prefills), as the
    engine's own timing would feed it on an idle machine: what it predicts does not depend
    on the load of the machine running the test."""
    costs = StepCostModel()
    for _ in range(8):
        costs.observe(1, 1, decode_s)
        costs.observe(1, 8, decode_s + 7 * per_token_s)
    return costs


def test_the_engine_orders_by_measured_costs_and_every_token_stays_exact():
    executor = FakeExecutor(num_slots=8)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=8,
        max_prefill_chunk_tokens=8,
        short_first_window_s=60.0,
    )
    engine = EngineCore(executor, config)
    warm = Request("warm", prompt(9, 8), SamplingParams(temperature=0.0, max_tokens=4))
    run_all(engine, [warm])  # the cost model has timed prefill and decode steps
    assert engine.costs.single_decode_s is not None
    # the order must not depend on this machine's load: fixed step costs and arrivals (a
    # measured prefill that ran faster than a decode, or a pause between the two arrivals
    # longer than their difference in work, once put the long request first)
    engine.costs = fixed_costs(DECODE_S, DECODE_S / 4)
    now = time.monotonic()
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (40, 1)]
    requests = [
        Request("long", prompt(1, 8), params[0], arrival_time_s=now),
        Request("short", prompt(2, 8), params[1], arrival_time_s=now + DECODE_S),
    ]
    out, _ = run_all(engine, requests)
    first_seq = {}
    for i, plan in enumerate(executor.plans):
        for s in plan.seqs:
            first_seq.setdefault(s.request_id, i)
    assert first_seq["short"] < first_seq["long"]
    assert out["long"] == reference_tokens(prompt(1, 8), 40)
    assert out["short"] == reference_tokens(prompt(2, 8), 1)


def test_one_token_calls_take_slots_away_from_the_long_generations():
    """Placement by max_tokens (Scheduler -> KVSlotPool `lasting`): interleaved arrivals, yet
    the long requests' decodes end up in consecutive slots, one forward pass a step."""
    sched = make(0.0, num_slots=8, budget=64)
    for i in range(3):
        sched.add_request(request(f"long-{i}", LASTING_DECODES + 1, float(10 + 2 * i)))
        sched.add_request(request(f"short-{i}", 1, float(11 + 2 * i)))
    plan = sched.schedule()
    slots = {s.request_id: s.slot_id for s in plan.seqs}
    assert [slots[f"long-{i}"] for i in range(3)] == [0, 1, 2]
    assert [slots[f"short-{i}"] for i in range(3)] == [7, 6, 5]
