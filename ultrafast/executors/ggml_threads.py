"""How many threads each forward pass of the ggml executor runs on, chosen from measurements.

llama.cpp runs a pass of one token on `n_threads` and any larger pass on `n_threads_batch`. On
a small machine the right count depends on the pass: a lone decode moves little data per
thread and its threads spin against the event loop that streams its tokens, while a pass of
sixteen sequences' decodes or a prefill chunk keeps every core busy. So at start the executor
times decode passes of several widths (sequences x 1 token) on each candidate count and keeps,
per width, the fewest threads within `margin` of the fastest: a thread that buys less than
that is worth more to the event loop, the tokenizer and the clients on the same cores. It also
times one prefill chunk, so wide passes (a burst of prompts is all prefill) get their own
measured count instead of the widest decode's: a compute-bound chunk and a decode of a few
sequences need not want the same count.

The timings must not be fooled by a neighbour: one start beside another process's start timed
a two-thread lone decode at 1,885 ms against 24 ms on one thread and served on one thread for
its whole life. So every (width, count) cell is timed CALIBRATION_REPS times, candidates
interleaved, and its median counts; a sample far above its cell's median is timed again; and a
width where more threads came out far slower than fewer (which an idle machine never shows) is
timed again from scratch. If it stays so, the plan is marked `contended`: used for now, never
cached, and measured again later (engine/start_costs.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

CALIBRATION_WIDTHS = (1, 2, 4, 8, 16)  # decode passes timed at start (capped at the slots)
CALIBRATION_PROMPT_TOKENS = 32  # context each timed sequence decodes after
CALIBRATION_REPS = 5  # the median of these counts (a stall elsewhere does not)
OUTLIER_FACTOR = 1.5  # a sample this far above its cell's median is timed again...
MAX_RETIMES = 3  # ...at most this many times per cell
# more threads this many times slower than fewer at the same width: another process held a
# core while it was timed (an idle machine shows at most the wake-up cost of a thread)
IMPLAUSIBLE_FACTOR = 2.0
WIDTH_RETRIES = 2  # an implausible width is timed again this many times before it is kept
THREAD_MARGIN = 0.10  # one more thread must make the pass this much faster to be used
# a start on a busy machine (or a large model) stops timing wider passes after this long; the
# widest width measured then covers the rest
CALIBRATION_BUDGET_S = 3.0
# one sequence's prefill chunk timed at start (right after the lone decode): its count is
# used for every pass at least this wide
PREFILL_CALIBRATION_TOKENS = 128


@dataclass(frozen=True)
class ThreadPlan:
    """Threads per pass width: `threads[i]` for passes of `widths[i]` tokens up to the next
    width; passes wider than the last measured width take its count."""

    widths: tuple[int, ...]
    threads: tuple[int, ...]
    timings_ms: tuple[tuple[float, ...], ...] = ()  # [width][candidate], for the start log
    candidates: tuple[int, ...] = ()  # the thread counts timed, in timings_ms's order
    contended: bool = False  # some width stayed implausible: use for now, never cache

    def __post_init__(self) -> None:
        if not self.widths or len(self.widths) != len(self.threads):
            raise ValueError("a thread plan needs one thread count per width")
        if list(self.widths) != sorted(set(self.widths)) or self.widths[0] != 1:
            raise ValueError("widths must ascend from 1")
        if min(self.threads) < 1:
            raise ValueError("thread counts must be >= 1")

    def for_tokens(self, num_tokens: int) -> int:
        chosen = self.threads[0]
        for width, threads in zip(self.widths, self.threads):
            if width > num_tokens:
                break
            chosen = threads
        return chosen

    def describe(self) -> str:
        text = ", ".join(f"{w} tok: {t} thr" for w, t in zip(self.widths, self.threads))
        return text + (" (contended: will be measured again)" if self.contended else "")

    def expected_ms(self, width: int) -> float | None:
        """The measured time of a pass of `width` (the largest timed width not above it) on the
        count chosen for it; None without timings."""
        if not self.timings_ms or len(self.candidates) != len(self.timings_ms[0]):
            return None
        row = 0
        for i, w in enumerate(self.widths):
            if w <= width:
                row = i
        return self.timings_ms[row][self.candidates.index(self.threads[row])]

    def to_json(self) -> dict:
        return {
            "widths": list(self.widths),
            "threads": list(self.threads),
            "timings_ms": [list(t) for t in self.timings_ms],
            "candidates": list(self.candidates),
        }

    @classmethod
    def from_json(cls, data: dict) -> ThreadPlan:
        return cls(
            tuple(int(w) for w in data["widths"]),
            tuple(int(t) for t in data["threads"]),
            tuple(tuple(float(x) for x in row) for row in data.get("timings_ms", ())),
            tuple(int(c) for c in data.get("candidates", ())),
        )


class CalibrationInterrupted(Exception):
    """`should_stop` said so between two passes (work arrived): nothing is kept."""


class NoFreeSlots(CalibrationInterrupted):
    """No run of consecutive slots holding nothing to time the passes in."""


def candidate_thread_counts(cores: int) -> tuple[int, ...]:
    """Every core, and every core but one (the old fixed split), when they differ."""
    return tuple(sorted({max(1, cores - 1), max(1, cores)}))


def choose_threads(timings_s: dict[int, float], margin: float = THREAD_MARGIN) -> int:
    """The fewest threads whose time is within `margin` of the fastest candidate's."""
    best = min(timings_s.values())
    return min(t for t, s in timings_s.items() if s <= best * (1 + margin))


def _time_cell_samples(
    time_pass: Callable[[int, int], float],
    width: int,
    candidates: tuple[int, ...],
    should_stop: Callable[[], bool],
) -> tuple[dict[int, float], float]:
    """Median seconds per candidate at `width`, outliers timed again; and the time spent."""
    samples: dict[int, list[float]] = {t: [] for t in candidates}
    spent_s = 0.0

    def timed(t: int) -> float:
        nonlocal spent_s
        if should_stop():
            raise CalibrationInterrupted
        elapsed_s = time_pass(width, t)
        spent_s += elapsed_s
        return elapsed_s

    # candidates alternate within each repetition, so a drift of the machine's speed during
    # the calibration weighs on both alike
    for _ in range(CALIBRATION_REPS):
        for t in candidates:
            samples[t].append(timed(t))
    for t in candidates:
        for _ in range(MAX_RETIMES):
            worst = max(samples[t])
            if worst <= statistics.median(samples[t]) * OUTLIER_FACTOR:
                break
            samples[t].remove(worst)
            samples[t].append(timed(t))
    return {t: statistics.median(v) for t, v in samples.items()}, spent_s


def implausible(medians_s: dict[int, float], factor: float = IMPLAUSIBLE_FACTOR) -> bool:
    """More threads far slower than fewer at the same width: someone else held a core."""
    counts = sorted(medians_s)
    return any(
        medians_s[more] > factor * medians_s[fewer]
        for i, fewer in enumerate(counts)
        for more in counts[i + 1 :]
    )


def calibrate(
    time_pass: Callable[[int, int], float],
    candidates: tuple[int, ...],
    max_width: int,
    margin: float = THREAD_MARGIN,
    widths: tuple[int, ...] = CALIBRATION_WIDTHS,
    budget_s: float | None = None,  # None: CALIBRATION_BUDGET_S
    prefill_tokens: int = 0,
    should_stop: Callable[[], bool] = lambda: False,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> ThreadPlan:
    """`time_pass(width, threads)` -> seconds of one pass: `width` sequences' decodes, or, for
    `width == prefill_tokens` (when it is wider than every decode width kept), one sequence's
    prefill chunk of that many tokens. The plan they imply. The lone decode and the prefill
    are timed first, wider decodes while the time budget lasts. `should_stop()` is asked
    before every pass: True raises CalibrationInterrupted; `progress(widths done, widths)`
    is told after each width."""
    budget_s = CALIBRATION_BUDGET_S if budget_s is None else budget_s
    kept = tuple(w for w in widths if w <= max(1, max_width))
    order = list(kept)
    if prefill_tokens > kept[-1]:
        order.insert(1, prefill_tokens)
    measured: dict[int, tuple[int, tuple[float, ...]]] = {}
    spent_s, contended = 0.0, False
    for width in order:
        if spent_s > budget_s:
            break
        for attempt in range(1 + WIDTH_RETRIES):
            medians, spent = _time_cell_samples(time_pass, width, candidates, should_stop)
            spent_s += spent
            if not implausible(medians):
                break
            if attempt == WIDTH_RETRIES or spent_s > budget_s:  # no time left to wait it out
                contended = True
                break
        measured[width] = (
            choose_threads(medians, margin),
            tuple(round(medians[t] * 1000, 2) for t in candidates),
        )
        progress(len(measured), len(order))
    timed = sorted(measured)
    return ThreadPlan(
        tuple(timed),
        tuple(measured[w][0] for w in timed),
        tuple(measured[w][1] for w in timed),
        tuple(candidates),
        contended,
    )
