"""How busy other processes kept this process's cores lately, read from the kernel's CPU
accounting: no pass is timed for it.

A pass on every core is llama.cpp's fastest on an idle machine and its slowest on a busy one
(each barrier waits for a thread that another process descheduled: a 128-token prefill took
1.6 s on two threads against 37 ms on one). Before the start costs are measured the engine
chooses on this figure: the busy time of the usable CPUs (/proc/stat) less this process's own
(/proc/self/stat), per second, over a window that opens when this module is imported (while
the model loads) and closes when asked.
"""

from __future__ import annotations

import os
import time

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest is in user)
MIN_WINDOW_S = 0.2  # a shorter window says nothing


def _cpus_busy_ticks(cpus: set[int]) -> int:
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                continue
            values = rest.split()
            busy += sum(int(values[i]) for i in _BUSY_FIELDS)
    return busy


def _own_ticks() -> int:
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


class BusyWindow:
    """Other processes' busy cores, among this process's usable CPUs, since `__init__`."""

    def __init__(self) -> None:
        self.cpus = os.sched_getaffinity(0)
        self.start = self._sample()

    def _sample(self) -> tuple[float, int, int] | None:
        try:
            return time.monotonic(), _cpus_busy_ticks(self.cpus), _own_ticks()
        except (OSError, ValueError, IndexError):  # no /proc (not Linux): unknown
            return None

    def others_busy_cores(self) -> float | None:
        """Cores' worth of CPU time other processes used per second since the window
        opened; None where unknown (no /proc, or a window too short to say)."""
        now = self._sample()
        if now is None or self.start is None or now[0] - self.start[0] < MIN_WINDOW_S:
            return None
        others = (now[1] - self.start[1]) - (now[2] - self.start[2])
        return max(0.0, others / _TICKS_PER_S / (now[0] - self.start[0]))


SINCE_IMPORT = BusyWindow()  # opened while the engine's modules load, before its first pass
