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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CALIBRATION_WIDTHS = (1, 2, 4, 8, 16)  # decode passes timed at start (capped at the slots)
CALIBRATION_PROMPT_TOKENS = 32  # context each timed sequence decodes after
CALIBRATION_REPS = 3  # the fastest of these counts (a stall elsewhere does not)
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
        return ", ".join(f"{w} tok: {t} thr" for w, t in zip(self.widths, self.threads))


def candidate_thread_counts(cores: int) -> tuple[int, ...]:
    """Every core, and every core but one (the old fixed split), when they differ."""
    return tuple(sorted({max(1, cores - 1), max(1, cores)}))


def choose_threads(timings_s: dict[int, float], margin: float = THREAD_MARGIN) -> int:
    """The fewest threads whose time is within `margin` of the fastest candidate's."""
    best = min(timings_s.values())
    return min(t for t, s in timings_s.items() if s <= best * (1 + margin))


def calibrate(
    time_pass: Callable[[int, int], float],
    candidates: tuple[int, ...],
    max_width: int,
    margin: float = THREAD_MARGIN,
    widths: tuple[int, ...] = CALIBRATION_WIDTHS,
    budget_s: float = CALIBRATION_BUDGET_S,
    prefill_tokens: int = 0,
) -> ThreadPlan:
    """`time_pass(width, threads)` -> seconds of one pass: `width` sequences' decodes, or, for
    `width == prefill_tokens` (when it is wider than every decode width kept), one sequence's
    prefill chunk of that many tokens. The plan they imply. The lone decode and the prefill
    are timed first, wider decodes while the time budget lasts."""
    kept = tuple(w for w in widths if w <= max(1, max_width))
    order = list(kept)
    if prefill_tokens > kept[-1]:
        order.insert(1, prefill_tokens)
    measured: dict[int, tuple[int, tuple[float, ...]]] = {}
    spent_s = 0.0
    for width in order:
        if spent_s > budget_s:
            break
        # candidates alternate within each repetition, so a drift of the machine's speed
        # during the calibration weighs on both alike
        best = {t: float("inf") for t in candidates}
        for _ in range(CALIBRATION_REPS):
            for t in candidates:
                elapsed_s = time_pass(width, t)
                best[t] = min(best[t], elapsed_s)
                spent_s += elapsed_s
        measured[width] = (
            choose_threads(best, margin),
            tuple(round(best[t] * 1000, 2) for t in candidates),
        )
    timed = sorted(measured)
    return ThreadPlan(
        tuple(timed),
        tuple(measured[w][0] for w in timed),
        tuple(measured[w][1] for w in timed),
    )
