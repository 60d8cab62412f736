"""cpu_contention.py: other processes' busy cores, from the kernel's accounting less
this process's own time."""

from __future__ import annotations

import os
import sys

import pytest

from ultrafast import cpu_contention

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_other_processes_busy_time_is_the_cpus_busy_time_less_our_own(monkeypatch):
    clock = {"t": 100.0, "cpus": 1000, "own": 50}
    monkeypatch.setattr(cpu_contention.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(cpu_contention, "_cpus_busy_ticks", lambda cpus: clock["cpus"])
    monkeypatch.setattr(cpu_contention, "_own_ticks", lambda: clock["own"])
    window = cpu_contention.BusyWindow()
    ticks = cpu_contention._TICKS_PER_S
    clock.update(t=102.0, cpus=1000 + 3 * ticks, own=50 + 2 * ticks)  # 3 s busy, 2 s ours
    assert window.others_busy_cores() == pytest.approx(0.5)
    clock.update(cpus=1000 + ticks, own=50 + 2 * ticks)  # ours only (rounding): never < 0
    assert window.others_busy_cores() == 0.0
    clock.update(t=100.1)
    assert window.others_busy_cores() is None  # too short a window to say


def test_it_reads_this_machine(monkeypatch):
    window = cpu_contention.BusyWindow()
    window.start = (window.start[0] - 1.0, *window.start[1:])  # opened a second ago
    busy = window.others_busy_cores()
    assert busy is not None and 0.0 <= busy <= len(os.sched_getaffinity(0)) * 1.5
