"""The engine step's parts: capabilities an executor declares, the step budget, the inbox."""

import pytest

from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.engine.read_api import (
    AbortRequest,
    AddRequest,
    Configure,
    EngineReadAPI,
    EngineSettings,
    Wake,
)
from ultrafast.engine.step_costs import StepBudget, StepCostModel
from ultrafast.engine.thread import EngineThread
from ultrafast.executors.base import ExecutorCaps
from ultrafast.executors.fake_exec import FakeExecutor
from ultrafast.request import Request, SamplingParams, ServiceTier


class DeclaringExecutor(FakeExecutor):
    """Says what it can do only through caps(): no capability attributes to probe."""

    keeps_logits = False

    def __init__(self, caps: ExecutorCaps, **kwargs):
        super().__init__(**kwargs)
        self._caps = caps

    def caps(self) -> ExecutorCaps:
        return self._caps


def core_for(caps: ExecutorCaps) -> EngineCore:
    executor = DeclaringExecutor(caps, num_slots=2)
    return EngineCore(executor, SchedulerConfig(max_num_seqs=2, max_model_len=128))


def test_the_engine_reads_what_an_executor_declares():
    plain = core_for(ExecutorCaps())
    assert not plain.scheduler.config.one_pass_per_length and not plain.scheduler._keeps_logits
    declared = core_for(ExecutorCaps(one_pass_per_length=True, keeps_logits=True))
    assert declared.scheduler.config.one_pass_per_length and declared.scheduler._keeps_logits
    gpu = core_for(ExecutorCaps(device_kind="gpu"))
    assert EngineThread(gpu).snapshot().device_kind == "gpu"


def test_thread_costs_are_cached_only_for_an_executor_that_calibrates():
    assert core_for(ExecutorCaps()).start_costs.identity() is None
    assert not core_for(ExecutorCaps(threads_auto=True)).start_costs.calibrates


def fitted_costs() -> StepCostModel:
    costs = StepCostModel()
    for _ in range(20):  # 1 ms a step plus 1 ms a token
        costs.observe(1, 1, 0.002, 0.002)
        costs.observe(1, 9, 0.010, 0.010)
    return costs


def test_the_step_budget_follows_the_tightest_running_tier():
    costs = fitted_costs()
    budget = StepBudget(priority_itl_target_s=0.005, default_itl_target_s=0.008)
    budget.resize(costs, [ServiceTier.DEFAULT, ServiceTier.PRIORITY])
    assert budget.priority_tokens == costs.token_budget(0.005) and budget.step_tokens is None
    budget.resize(costs, [ServiceTier.DEFAULT])
    assert budget.step_tokens == costs.token_budget(0.008)
    assert budget.priority_tokens == costs.token_budget(0.005)  # kept for the next priority step
    assert budget.capped(3) == min(3, budget.step_tokens) and budget.capped(None) == 7
    budget.resize(costs, [ServiceTier.FLEX])
    assert budget.step_tokens is None and budget.capped(3) == 3


def test_an_auto_priority_target_is_sized_from_the_idle_decode():
    costs = fitted_costs()
    budget = StepBudget(priority_itl_target_s=0)
    budget.resize(costs, [ServiceTier.PRIORITY])
    assert budget.priority_tokens == costs.token_budget(costs.auto_itl_target_s())


def test_the_inbox_carries_typed_items_and_the_read_api_is_a_member():
    engine = EngineThread(core_for(ExecutorCaps()))  # not started: the items stay queued
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    seen = []
    settings = EngineSettings(reserved_priority_seats={"acme": 1})
    engine.submit(request, seen.append)
    engine.abort("r")
    engine.configure(settings)
    engine._inbox.put(Wake())
    items = [engine._inbox.get_nowait() for _ in range(4)]
    assert items == [
        AddRequest(request, seen.append),
        AbortRequest("r"),
        Configure(settings),
        Wake(),
    ]
    assert isinstance(engine.read, EngineReadAPI) and not isinstance(engine, EngineReadAPI)
    for item in items:  # as the engine thread handles them
        engine._handle(item)
    assert engine.core.scheduler.reserved_priority_seats == {"acme": 1}
    assert "r" not in engine.core.scheduler.requests  # added, then aborted


def test_decode_only_steps_keep_a_prompt_token_at_its_measured_cost():
    """A phase of decode steps alone (every token its own sequence, each reading a long KV)
    must not make a prompt token cost what a decode costs: that priced 16 queued 1,000-token
    prompts at ~32 s and refused them (429)."""
    costs = StepCostModel()
    for _ in range(30):  # one stream: 10 ms a step, 0.2 ms a token (prefill and decode)
        costs.observe(1, 512, 0.010 + 512 * 0.0002)
        costs.observe(1, 1, 0.010 + 0.0002)
    assert costs.per_token_s == pytest.approx(0.0002, rel=0.01)
    for _ in range(20):  # then only decodes, widths 16 .. 2: 2.1 ms more for each sequence
        for width in range(16, 1, -1):
            costs.observe(width, width, 0.010 + 0.0021 * (width - 1) + 0.0002 * width)
    assert costs.per_token_s == pytest.approx(0.0002, rel=0.01)
    assert costs.per_seq_s == pytest.approx(0.0021, rel=0.05)
    wide_decode = costs.base_s + 15 * costs.per_seq_s + 16 * costs.per_token_s
    assert wide_decode == pytest.approx(0.010 + 0.0021 * 15 + 0.0002 * 16, rel=0.05)
    assert 16_000 * costs.per_token_s < 4.0  # 16 x 1,000 prompt tokens: ~3.2 s, not ~37 s


class PassCountingExecutor(DeclaringExecutor):
    """Runs every step as `passes` forward passes, and says so (None: says nothing)."""

    def __init__(self, passes: int | None):
        super().__init__(ExecutorCaps(one_pass_per_length=True), num_slots=2)
        self.passes = passes

    def execute(self, plan):
        result = super().execute(plan)
        result.num_passes = self.passes
        return result


@pytest.mark.parametrize("passes, mixed_observed", [(None, False), (2, False), (1, True)])
def test_a_step_of_mixed_lengths_teaches_the_costs_only_when_it_was_one_pass(
    passes, mixed_observed
):
    """An executor that runs each length as its own pass leaves a mixed step out of the
    step-cost line (one base per pass: no line fits it); one that says it ran the step as one
    pass (the wide path's torch pass: prefill chunks and decodes together) has it learned:
    without it a cold server had learned decode steps only and refused queued prompts."""
    core = EngineCore(
        PassCountingExecutor(passes), SchedulerConfig(max_num_seqs=2, max_model_len=128)
    )
    observed: list[tuple[int, int]] = []
    real = core.costs.observe
    core.costs.observe = lambda s, t, *a: observed.append((s, t)) or real(s, t, *a)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    core.add_request(Request("a", [1, 2, 3], greedy))
    core.step()  # a's prefill: one length
    core.add_request(Request("b", list(range(1, 9)), greedy))
    core.step()  # a's decode beside b's 8-token prefill: two lengths
    assert observed[0] == (1, 3) if passes != 2 else observed == []
    assert ((2, 9) in observed) == mixed_observed
