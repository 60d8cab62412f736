"""The thread plan: threads per pass width, chosen from timings (fed here, measured at start)."""

import pytest

from ultrafast.executors.ggml_threads import (
    ThreadPlan,
    calibrate,
    candidate_thread_counts,
    choose_threads,
)


def test_plan_looks_up_the_largest_measured_width_not_above_the_pass():
    plan = ThreadPlan((1, 4, 16), (1, 2, 3))
    assert [plan.for_tokens(n) for n in (1, 2, 3, 4, 15, 16, 500)] == [1, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    "widths,threads", [((), ()), ((2, 4), (1, 1)), ((1, 4), (1,)), ((1,), (0,))]
)
def test_plan_refuses_malformed_tables(widths, threads):
    with pytest.raises(ValueError):
        ThreadPlan(widths, threads)


def test_more_threads_only_when_they_pay_their_margin():
    assert choose_threads({1: 10.0, 2: 9.5}, margin=0.1) == 1  # 5% faster: not worth a core
    assert choose_threads({1: 10.0, 2: 6.0}, margin=0.1) == 2
    assert choose_threads({1: 6.0, 2: 10.0}, margin=0.1) == 1


def test_candidates_are_all_cores_and_all_but_one():
    assert candidate_thread_counts(1) == (1,)
    assert candidate_thread_counts(2) == (1, 2)
    assert candidate_thread_counts(16) == (15, 16)


def test_calibration_picks_per_width_from_the_timings():
    """A machine where one thread wins a lone decode and two win wide passes."""
    calls = []

    def time_pass(width: int, threads: int) -> float:
        calls.append((width, threads))
        per_token = 1.0 if threads == 1 else 0.55
        overhead = 0.2 if threads == 1 else 0.9  # the second thread's wake-up and spinning
        return overhead + per_token * width

    plan = calibrate(time_pass, (1, 2), max_width=16, margin=0.1, budget_s=float("inf"))
    assert plan.widths == (1, 2, 4, 8, 16)
    assert plan.threads == (1, 1, 2, 2, 2)
    assert {w for w, _ in calls} == set(plan.widths)
    # capped at the executor's slots
    assert calibrate(time_pass, (1, 2), max_width=3, budget_s=float("inf")).widths == (1, 2)


def test_a_prefill_chunk_gets_its_own_count_when_no_decode_earns_a_second_thread():
    """A machine where one thread is as fast for every decode up to 16 sequences, but a
    128-token prefill runs nearly twice as fast on two: wide passes get the prefill's count,
    not the widest decode's."""
    calls = []

    def time_pass(width: int, threads: int) -> float:
        calls.append(width)
        if width == 128:
            return 30.0 if threads == 1 else 17.0
        return 1.0 + 0.1 * width  # threads make no difference

    plan = calibrate(time_pass, (1, 2), max_width=16, budget_s=float("inf"), prefill_tokens=128)
    assert plan.widths == (1, 2, 4, 8, 16, 128) and plan.threads == (1, 1, 1, 1, 1, 2)
    assert [plan.for_tokens(n) for n in (1, 16, 127, 128, 512)] == [1, 1, 1, 2, 2]
    assert calls[:6] == [1] * 6 and calls[6:12] == [128] * 6  # timed right after width 1
    # no prefill width when the chunk is no wider than the widest decode kept
    unlimited = float("inf")
    assert calibrate(time_pass, (1, 2), 16, budget_s=unlimited, prefill_tokens=8).widths == (
        1,
        2,
        4,
        8,
        16,
    )
    assert calibrate(time_pass, (1, 2), 4, budget_s=unlimited, prefill_tokens=4).widths == (1, 2, 4)


def test_calibration_stops_widening_past_its_time_budget():
    def slow_pass(width: int, threads: int) -> float:
        return 0.5 * width  # a busy machine: every pass takes long

    plan = calibrate(slow_pass, (1, 2), max_width=16, budget_s=2.0)
    # width 1 spends 3 s (3 reps x 2 counts x 0.5 s): nothing wider is timed
    assert plan.widths == (1,) and len(plan.timings_ms) == 1
    assert plan.for_tokens(16) == plan.threads[0]
