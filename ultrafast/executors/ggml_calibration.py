"""The ggml executor's thread calibration run on the executor itself (the statistics and the
plan are in ggml_threads.py), and what its result depends on (the start-cost cache's key).

It times real passes on the idle executor, with the first slots as scratch: a context of
CALIBRATION_PROMPT_TOKENS per scratch slot, then lone and wide decodes after it and one
prefill chunk, on each candidate thread count. Every slot it touched is left empty, whether it
finished or was interrupted (work arrived while it ran in the background).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import llama_cpp

from ultrafast.core.types import ScheduledSeq, StepPlan
from ultrafast.executors.ggml_threads import (
    CALIBRATION_PROMPT_TOKENS,
    CALIBRATION_WIDTHS,
    PREFILL_CALIBRATION_TOKENS,
    CalibrationInterrupted,
    NoFreeSlots,
    ThreadPlan,
    calibrate,
    candidate_thread_counts,
)
from ultrafast.request import SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

    from ultrafast.core.types import StepResult


class CalibratedExecutor(Protocol):
    """What the calibration uses of the ggml executor (a Protocol: no import back)."""

    gguf_path: Path
    weights_path: Path
    kv_cache_dtype: str
    flash_attn: bool
    max_model_len: int
    max_num_batched_tokens: int
    num_slots: int
    vocab_size: int
    thread_plan: ThreadPlan | None
    _memory: Any
    _slot_lens: list[int]

    def execute(self, plan: StepPlan) -> StepResult: ...


def cost_identity(ex: CalibratedExecutor) -> dict:
    """The model file as it is on disk and the flags that shape a pass."""
    stat = ex.gguf_path.stat()
    return {
        "model": str(ex.gguf_path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "widest_decode": min(ex.num_slots, max(CALIBRATION_WIDTHS)),
        "batch": ex.max_num_batched_tokens,
        "max_model_len": ex.max_model_len,
        "flash_attn": ex.flash_attn,
        "kv_cache_dtype": ex.kv_cache_dtype,
        "llama_cpp": getattr(llama_cpp, "__version__", "?"),
        "weights": ex.weights_path.name,  # the file llama.cpp runs (f16_twin.py)
    }


def first_run(free_slots: list[int], width: int) -> int | None:
    """The first of `width` consecutive slots in `free_slots` (a wide decode over slots that
    are not consecutive is several passes in llama.cpp, not the pass to time), or None."""
    free = set(free_slots)
    return next((s for s in sorted(free) if all(s + i in free for i in range(width))), None)


def calibrate_executor(
    ex: CalibratedExecutor,
    cores: int,
    margin: float,
    should_stop: Callable[[], bool],
    free_slots: list[int] | None = None,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> ThreadPlan:
    """Time decode passes of several widths and one prefill chunk on each candidate thread
    count and keep the plan they imply as `ex.thread_plan`. `should_stop()` is asked between
    passes; True raises CalibrationInterrupted with the thread plan left as it was. With
    `free_slots` (slots holding nothing, a re-check while serving) the scratch slots are
    consecutive ones among them; none such also raises CalibrationInterrupted."""
    width = min(ex.num_slots, max(CALIBRATION_WIDTHS), ex.max_num_batched_tokens)
    base = 0 if free_slots is None else first_run(free_slots, width)
    if base is None:
        raise NoFreeSlots(f"no {width} consecutive free slots to time passes in")
    context = min(CALIBRATION_PROMPT_TOKENS, ex.max_model_len - 2)
    chunk = min(PREFILL_CALIBRATION_TOKENS, ex.max_num_batched_tokens, ex.max_model_len)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    prompt = [(i * 31 + 7) % ex.vocab_size for i in range(max(context, chunk))]

    def seq(scratch: int, token_ids: list[int], start: int) -> ScheduledSeq:
        slot = base + scratch
        return ScheduledSeq(f"calibration-{slot}", slot, token_ids, start, 1, greedy, 0, 0)

    def time_pass(num_seqs: int, threads: int) -> float:
        ex.thread_plan = ThreadPlan((1,), (threads,))  # every pass on `threads`
        if num_seqs > width:  # the prefill chunk, in slot 0 (its context is rewritten)
            plan = StepPlan([seq(0, prompt[:chunk], 0)])
        else:
            plan = StepPlan([seq(s, prompt[:1], context) for s in range(num_seqs)])
        start_s = time.perf_counter()
        result = ex.execute(plan)
        elapsed_s = time.perf_counter() - start_s
        if result.errors:
            raise RuntimeError(f"thread calibration failed: {result.errors}")
        return elapsed_s

    before = ex.thread_plan
    try:
        for slot in range(width):
            if should_stop():
                raise CalibrationInterrupted
            ex.execute(StepPlan([seq(slot, prompt[:context], 0)]))
        plan = calibrate(
            time_pass,
            candidate_thread_counts(cores),
            width,
            margin,
            prefill_tokens=chunk if chunk > width else 0,
            should_stop=should_stop,
            progress=progress,
        )
    finally:
        for slot in range(base, base + width):
            llama_cpp.llama_memory_seq_rm(ex._memory, slot, -1, -1)
            ex._slot_lens[slot] = 0
        ex.thread_plan = before
    ex.thread_plan = plan
    return plan
