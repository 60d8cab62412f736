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

from collections.abc import Callable
from dataclasses import dataclass

from ultrafast.core.types import ScheduledSeq, StepPlan
from ultrafast.executors.wide_route import time_both_paths
from ultrafast.request import SamplingParams

DECODE_WIDTHS = (4, 8, 16)
NARROW_MAX = 2  # steps this narrow never run in torch
CONTEXT_TOKENS = 64  # each measured slot holds this many positions before the timed step
_REPEATS = 3
ON_MIN_WIDTH = 4  # --wide-pass on where no crossover was measured


@dataclass
class DecodeRouter:
    """Which path a step's decodes take: on_width 0 = llama.cpp always."""

    on_width: int = 0
    active: bool = False

    @property
    def off_width(self) -> int:
        return max(NARROW_MAX + 1, self.on_width - max(1, self.on_width // 4))

    def wide(self, width: int) -> bool:
        if not width:  # a step without decodes (a prefill alone) leaves the state as it was
            return False
        if not self.on_width or width <= NARROW_MAX:
            self.active = False
            return False
        self.active = width >= (self.off_width if self.active else self.on_width)
        return self.active


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
    if width is None and mode == "auto":
        executor.decode_router = DecodeRouter(0)
        return f"decode steps on llama.cpp (torch measured not faster: {shown})"
    executor.decode_router = router = DecodeRouter(width or ON_MIN_WIDTH)
    return (
        f"decode steps of >= {router.on_width} sequences in torch (until < {router.off_width}), "
        f"narrower on llama.cpp (measured: {shown})"
    )


def measure_decode(
    executor, slots: list[int], should_stop: Callable[[], bool] = lambda: False
) -> tuple[float, float]:
    """Seconds of one decode step over `slots` (each at CONTEXT_TOKENS positions) on
    llama.cpp and in torch, the fastest of a few; the slots are left empty."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = [(i * 31 + 7) % executor.vocab_size for i in range(CONTEXT_TOKENS)]
    seqs = [ScheduledSeq(f"wide-decode-{s}", s, prompt, 0, 0, greedy, 0, 0) for s in slots]
    step = StepPlan(
        [ScheduledSeq(s.request_id, s.slot_id, [7], CONTEXT_TOKENS, 1, greedy, 0, 0) for s in seqs]
    )

    def use(wide: bool) -> None:
        executor.decode_force = wide

    try:
        use(False)
        for s in seqs:  # one slot a step: a step may hold fewer tokens than all the contexts
            result = executor.execute(StepPlan([s]))
            if result.errors:
                raise RuntimeError(f"wide-decode calibration failed: {result.errors}")
        # the warm-up round also moves the slots' KV into the mirror
        return time_both_paths(
            executor, step, use, _REPEATS, "wide-decode calibration", should_stop
        )
    finally:
        executor.decode_force = None
        for s in seqs:
            executor._trim_slot(s.slot_id, 0)
