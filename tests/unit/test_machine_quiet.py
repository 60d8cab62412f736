"""bench serve waits for a quiet machine before each level (bench/machine_quiet.py)."""

from __future__ import annotations

import os

from ultrafast_harness.bench import machine_quiet

TICKS = os.sysconf("SC_CLK_TCK")


class FakeMachine:
    """Busy cores per one-second window, in turn; a clock the waits advance."""

    def __init__(self, busy_per_window: list[float]) -> None:
        self.windows, self.now, self.ticks = list(busy_per_window), 0.0, 0.0

    def read(self) -> int:
        return int(self.ticks)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        busy = self.windows.pop(0) if self.windows else 0.0
        self.now += seconds
        self.ticks += busy * TICKS * seconds


def wait(machine: FakeMachine, **kwargs):
    return machine_quiet.wait_quiet(
        read=machine.read, clock=machine.clock, sleep=machine.sleep, **kwargs
    )


def test_a_quiet_machine_starts_at_once():
    waited, busy = wait(FakeMachine([0.02]))
    assert waited == 1.0 and busy <= machine_quiet.QUIET_CORES


def test_a_busy_machine_is_waited_for_until_quiet():
    waited, busy = wait(FakeMachine([1.9, 1.2, 0.6, 0.05]))
    assert waited == 4.0 and busy <= machine_quiet.QUIET_CORES


def test_the_wait_is_bounded_and_says_how_busy_it_stayed():
    waited, busy = wait(FakeMachine([2.0] * 100), max_wait_s=5.0)
    assert waited == 5.0 and busy >= 1.9


def test_the_real_machine_reads():
    assert machine_quiet.busy_ticks() > 0
