"""CPU time of a running server's threads while a load runs: where the cores go.

Usage: python scripts/server_thread_cpu.py PID SECONDS
Prints, per thread name (the event loop is the process's main thread, the engine thread is
`ultrafast-engine`, ggml's kernel workers are the unnamed native threads), the CPU seconds
spent in the window and the share of one core. Run it beside a load generator (e.g.
`ultrafast bench serve`) to see how much of the machine the event loop takes per token.
"""

from __future__ import annotations

import collections
import os
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far per thread name (threads of one name summed)."""
    totals: dict[str, float] = collections.defaultdict(float)
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{task_dir}/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended
        if tid == str(pid):
            name = "main (event loop)"
        totals[name] += (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
    return totals


def main(argv: list[str]) -> int:
    pid, seconds = int(argv[1]), float(argv[2])
    before = thread_cpu(pid)
    time.sleep(seconds)
    after = thread_cpu(pid)
    rows = sorted(((after[n] - before.get(n, 0.0), n) for n in after), reverse=True)
    for spent, name in rows:
        if spent > 0:
            print(f"{name:24s} {spent:7.2f} s  {100 * spent / seconds:5.1f}% of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
