"""From which width decode steps run in torch (wide_decode.py): measured at start, with
hysteresis while serving.

Never by CPU name: once the wide prefill path is on (wide_route.py found oneDNN bf16 and the
model), both paths time one decode step of each width in DECODE_WIDTHS over the same slots at
the same positions (interleaved, the fastest of a few: other load only adds time). The on
width is the narrowest from which torch is cheaper at every wider measured width; none means
decodes stay on llama.cpp. Steps of 1-2 decodes always stay there: llama.cpp's 1-token pass is
the cheaper one (18 vs >= 21 ms in the note's measurements), and not timing them saves start
time. While serving, a step goes wide from the on width and stays wide
until its width falls below the off width (a quarter lower): every switch moves the KV of the
step's slots from one side to the other, so a width that hovers around the threshold must not
flip the path each step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ultrafast.core.types import ScheduledSeq, StepPlan
from ultrafast.executors.ggml_threads import CalibrationInterrupted
from ultrafast.executors.wide_route import time_both_paths
from ultrafast.request import SamplingParams

DECODE_WIDTHS = (4, 8, 16)
NARROW_MAX = 2  # steps this narrow never run in torch
CONTEXT_TOKENS = 64  # each measured slot holds this many positions before the timed step
LONG_CONTEXT = 512  # ... and once more at this many, at the narrowest width (the slopes)
_REPEATS = 3
ON_MIN_WIDTH = 4  # --wide-pass on where no crossover was measured
STAY_SHARE = 0.75  # a wide step stays wide down to this share of the positions it needed


@dataclass
class DecodeRouter:
    """Which path a step's decodes take: from `on_width` decodes at any context (0: none),
    and at a measured width from `from_positions[width]` positions per slot on average (the
    longer contexts, where llama.cpp's attention is the slower: 16 decodes at 1,000 positions
    175 ms against torch's 94, 2-core AVX2 EPYC, where at 64 positions torch was 6% slower)."""

    on_width: int = 0
    from_positions: dict[int, int] = field(default_factory=dict)
    active: bool = False

    @property
    def off_width(self) -> int:
        return max(NARROW_MAX + 1, self.on_width - max(1, self.on_width // 4))

    @property
    def enabled(self) -> bool:
        """Whether any step can run in torch."""
        return self.on_width > 0 or bool(self.from_positions)

    def wide(self, width: int, positions: int = 0) -> bool:
        """Whether a step of `width` decodes whose slots hold `positions` positions in all
        runs in torch."""
        if not width:  # a step without decodes (a prefill alone) leaves the state as it was
            return False
        if not self.enabled or width <= NARROW_MAX:
            self.active = False
            return False
        by_width = self.on_width and width >= (self.off_width if self.active else self.on_width)
        needed = self.positions_needed(width)
        by_context = needed is not None and positions >= width * needed * (
            STAY_SHARE if self.active else 1
        )
        self.active = bool(by_width or by_context)
        return self.active

    def positions_needed(self, width: int) -> int | None:
        """The mean positions per slot from which a step of `width` decodes runs in torch:
        the widest measured width's up to `width` (None: none measured, or never)."""
        measured = [w for w in self.from_positions if w <= width]
        return self.from_positions[max(measured)] if measured else None


def from_positions(
    short: dict[int, tuple[float, float]], slopes: tuple[float, float], long_context: int
) -> dict[int, int]:
    """Per measured width where torch is not the cheaper at CONTEXT_TOKENS, the positions per
    slot from which it is: each path's step time as a line in the positions (its time at
    CONTEXT_TOKENS plus its slope, seconds per slot-position, times the positions beyond),
    crossing below `long_context` * 4 (further out the lines are guesses); none where
    torch's slope is not the smaller."""
    ggml_slope, torch_slope = slopes
    found = {}
    for width, (ggml_s, torch_s) in short.items():
        if torch_s < ggml_s or torch_slope >= ggml_slope:
            continue
        beyond = (torch_s - ggml_s) / ((ggml_slope - torch_slope) * width)
        if CONTEXT_TOKENS + beyond <= long_context * 4:
            found[width] = math.ceil(CONTEXT_TOKENS + beyond)
    return found


def on_width(timings: dict[int, tuple[float, float]]) -> int | None:
    """The narrowest width from which torch is cheaper at every wider one, from (llama.cpp,
    torch) seconds per width; None when it is not cheaper at the widest."""
    chosen = None
    for width in sorted(timings, reverse=True):
        ggml_s, torch_s = timings[width]
        if torch_s >= ggml_s:
            break
        chosen = width
    return chosen


def plan_wide_decode(
    executor,
    mode: str,
    slots: list[int] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> str:
    """Set executor.decode_router for `mode` ('auto' or 'on'), timing in `slots` (free ones;
    default all, on an executor that serves nothing yet); the status line's clause."""
    slots = list(range(executor.num_slots)) if slots is None else slots
    widths = [w for w in DECODE_WIDTHS if w <= min(len(slots), 16)]
    too_short = min(executor.max_model_len - 1, executor.max_num_batched_tokens) < CONTEXT_TOKENS
    if too_short or not widths:
        executor.decode_router = DecodeRouter(ON_MIN_WIDTH if mode == "on" else 0)
        return "decode steps on llama.cpp (too few slots or positions to measure)"
    timings = {w: measure_decode(executor, slots[:w], should_stop) for w in widths}
    shown = ", ".join(
        f"{w} wide {g * 1e3:.0f} ms llama.cpp / {t * 1e3:.0f} ms torch"
        for w, (g, t) in timings.items()
    )
    width = on_width(timings)
    longer, long_shown = _longer_contexts(executor, timings, width, slots, should_stop)
    if width is None and not longer and mode == "auto":
        executor.decode_router = DecodeRouter(0)
        return f"decode steps on llama.cpp (torch measured not faster: {shown}{long_shown})"
    on = width or (ON_MIN_WIDTH if mode == "on" else 0)  # auto: by context alone
    executor.decode_router = router = DecodeRouter(on, longer)
    parts = []
    if on:
        parts.append(f"decode steps of >= {on} sequences in torch (until < {router.off_width})")
    if longer:
        starts = ", ".join(f"{w} wide from {p} positions a slot" for w, p in sorted(longer.items()))
        parts.append(f"at longer contexts {starts}")
    said = ", ".join(parts) if on else f"decode steps in torch {parts[0]}"
    return f"{said}, the rest on llama.cpp (measured: {shown}{long_shown})"


def _longer_contexts(
    executor,
    timings: dict[int, tuple[float, float]],
    width: int | None,
    slots: list[int],
    should_stop: Callable[[], bool],
) -> tuple[dict[int, int], str]:
    """Where torch is not the cheaper at every measured width, the narrowest width timed
    again at LONG_CONTEXT positions: each path's slope, and from it `from_positions`; with
    the status clause. Nothing where the slots cannot hold that many positions."""
    narrowest = min(timings)
    long_context = min(LONG_CONTEXT, executor.max_model_len - 2)
    if width == narrowest or long_context <= CONTEXT_TOKENS * 2:
        return {}, ""
    ggml_s, torch_s = measure_decode(executor, slots[:narrowest], should_stop, long_context)
    extra = narrowest * (long_context - CONTEXT_TOKENS)
    slopes = (
        (ggml_s - timings[narrowest][0]) / extra,
        (torch_s - timings[narrowest][1]) / extra,
    )
    longer = from_positions(
        {w: t for w, t in timings.items() if width is None or w < width}, slopes, long_context
    )
    shown = (
        f"; {narrowest} wide at {long_context} positions {ggml_s * 1e3:.0f} ms llama.cpp / "
        f"{torch_s * 1e3:.0f} ms torch"
    )
    return longer, shown


def measure_decode(
    executor,
    slots: list[int],
    should_stop: Callable[[], bool] = lambda: False,
    context: int = CONTEXT_TOKENS,
) -> tuple[float, float]:
    """Seconds of one decode step over `slots` (each at `context` positions) on llama.cpp
    and in torch, the fastest of a few; the slots are left empty."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = [(i * 31 + 7) % executor.vocab_size for i in range(context)]
    chunk = executor.max_num_batched_tokens
    step = StepPlan(
        [ScheduledSeq(f"wide-decode-{s}", s, [7], context, 1, greedy, 0, 0) for s in slots]
    )

    def use(wide: bool) -> None:
        executor.decode_force = wide

    try:
        use(False)
        for s in slots:  # one chunk a step: a step may hold fewer tokens than all the contexts
            for start in range(0, context, chunk):
                if should_stop():
                    raise CalibrationInterrupted
                part = prompt[start : start + chunk]
                seq = ScheduledSeq(f"wide-decode-{s}", s, part, start, 0, greedy, 0, 0)
                result = executor.execute(StepPlan([seq]))
                if result.errors:
                    raise RuntimeError(f"wide-decode calibration failed: {result.errors}")
        # the warm-up round also moves the slots' KV into the mirror
        return time_both_paths(
            executor, step, use, _REPEATS, "wide-decode calibration", should_stop
        )
    finally:
        executor.decode_force = None
        for s in slots:
            executor._trim_slot(s, 0)
