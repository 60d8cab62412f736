"""The thread plan: threads per pass width, chosen from timings (fed here, measured at start)."""

import pytest

from ultrafast.executors.ggml_threads import (
    CALIBRATION_REPS,
    CalibrationInterrupted,
    ThreadPlan,
    calibrate,
    candidate_thread_counts,
    choose_threads,
    implausible,
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

    told = []
    plan = calibrate(
        time_pass,
        (1, 2),
        max_width=16,
        margin=0.1,
        budget_s=float("inf"),
        progress=lambda done, total: told.append((done, total)),
    )
    assert plan.widths == (1, 2, 4, 8, 16)
    assert told == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]  # /ready's progress
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
    reps = 2 * CALIBRATION_REPS
    assert calls[:reps] == [1] * reps and calls[reps : 2 * reps] == [128] * reps  # after width 1
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
    # width 1 spends 5 s (5 reps x 2 counts x 0.5 s): nothing wider is timed
    assert plan.widths == (1,) and len(plan.timings_ms) == 1
    assert plan.for_tokens(16) == plan.threads[0]


def _machine(per_thread_ms: dict[int, float]):
    """A pass whose time depends on the thread count only (ms -> s)."""
    return lambda width, threads: per_thread_ms[threads] / 1000


def test_a_neighbours_start_during_the_timing_does_not_pick_the_count():
    """The start that chose one thread for life: another process held the second core while
    the two-thread passes were timed (1,885 ms against 24 ms). The width is timed again and
    the count comes from the quiet timings; nothing is marked contended."""
    quiet = _machine({1: 24.0, 2: 14.0})
    stalls = {"left": 2 * CALIBRATION_REPS}  # every two-thread pass of the first try

    def time_pass(width: int, threads: int) -> float:
        if threads == 2 and stalls["left"] > 0:
            stalls["left"] -= 1
            return 1.885
        return quiet(width, threads)

    plan = calibrate(time_pass, (1, 2), max_width=1, budget_s=float("inf"))
    assert plan.threads == (2,) and not plan.contended


def test_a_stalled_sample_is_timed_again_and_the_median_holds():
    calls = []
    stall_at = {3}

    def time_pass(width: int, threads: int) -> float:
        calls.append(threads)
        if len(calls) in stall_at:
            return 5.0  # one page fault storm
        return 0.010 if threads == 1 else 0.006

    plan = calibrate(time_pass, (1, 2), max_width=1, budget_s=float("inf"))
    assert plan.threads == (2,) and plan.timings_ms == ((10.0, 6.0),)
    assert len(calls) == 2 * CALIBRATION_REPS + 1  # the stalled sample, and only it, again


def test_contention_that_lasts_is_kept_for_now_but_marked():
    plan = calibrate(_machine({1: 24.0, 2: 1885.0}), (1, 2), max_width=1, budget_s=float("inf"))
    assert plan.threads == (1,) and plan.contended
    assert "contended" in plan.describe()
    assert implausible({1: 0.024, 2: 0.06}) and not implausible({1: 0.024, 2: 0.03})


def test_calibration_gives_way_between_passes():
    calls = []

    def time_pass(width: int, threads: int) -> float:
        calls.append(width)
        return 0.01

    with pytest.raises(CalibrationInterrupted):
        calibrate(time_pass, (1, 2), 16, budget_s=float("inf"), should_stop=lambda: len(calls) >= 3)
    assert len(calls) == 3


def test_plan_round_trips_through_json_and_knows_its_timings():
    plan = calibrate(_machine({1: 10.0, 2: 6.0}), (1, 2), max_width=4, budget_s=float("inf"))
    again = ThreadPlan.from_json(plan.to_json())
    assert again == plan
    assert again.expected_ms(1) == 6.0 and again.expected_ms(3) == 6.0
    assert ThreadPlan((1,), (1,)).expected_ms(1) is None  # no timings: nothing to expect


def test_a_recheck_times_passes_only_in_consecutive_free_slots():
    pytest.importorskip("llama_cpp")
    from ultrafast.executors.ggml_calibration import first_run

    assert first_run([0, 1, 2, 3], 4) == 0
    assert first_run([5, 1, 2, 3, 7, 6, 4], 4) == 1
    assert first_run([0, 2, 3, 5, 6], 3) is None  # a wide decode over scattered slots is
    assert first_run([], 1) is None  # several passes in llama.cpp: not the pass to time
