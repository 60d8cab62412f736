"""Wait for a quiet machine before a benchmark level: every server of `bench serve` stays up for
the whole run, and one that just started or served (a peer's warm-up, its threads finishing
work) can still use the cores when the next level begins on another server.

Why: ours' batch-1 level ran right after vLLM's start and warm-up and measured a 533-822 ms
first token in three full runs, against 95-190 ms for the same server alone, even right
after a 90 s two-core load had ended. A level starts only when the machine's busy time, all
processes together, stays under QUIET_CORES for a whole window, or after MAX_WAIT_S (then the
report says how busy it still was).
"""

from __future__ import annotations

import time

QUIET_CORES = 0.15  # cores' worth of busy time per second, every process together
WINDOW_S = 1.0
MAX_WAIT_S = 60.0
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal


def busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]  # the first line: every CPU together
    return sum(int(fields[i]) for i in _BUSY_FIELDS)


def wait_quiet(
    quiet_cores: float = QUIET_CORES,
    window_s: float = WINDOW_S,
    max_wait_s: float = MAX_WAIT_S,
    read=busy_ticks,
    clock=time.monotonic,
    sleep=time.sleep,
) -> tuple[float, float]:
    """(seconds waited, busy cores in the last window); returns at the first quiet window."""
    import os

    ticks_per_s = os.sysconf("SC_CLK_TCK")
    started = clock()
    busy = float("nan")
    while True:
        before, t0 = read(), clock()
        sleep(window_s)
        busy = (read() - before) / ticks_per_s / max(clock() - t0, 1e-9)
        if busy <= quiet_cores or clock() - started >= max_wait_s:
            return clock() - started, busy
