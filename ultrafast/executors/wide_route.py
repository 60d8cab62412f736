"""Whether, and from how many tokens, prefill chunks take the wide path: decided by measuring.

Never by CPU name: feature detection says whether the path can run at all (oneDNN present,
a float KV cache, a model the wide forward implements, memory for its weights in the measured
GEMM dtype, packed_linear.gemm_dtype), then both paths time one prefill chunk of a short and
of a long length on this machine, and the crossover between the two lines is the routing
threshold. Where the wide path is not faster even on the long chunk, prefill chunks stay on
llama.cpp; the path stays off unless its decode steps measured faster (wide_decode_route.py:
on the AVX2 EPYC, float16 weight copies made torch's 16-wide decode step the faster while its
prefill was not), in which case chunks run in torch only inside those steps (DECODE_ONLY).
The returned status is the one startup log line that says which path runs and why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ultrafast.core.types import ScheduledSeq, StepPlan
from ultrafast.executors.ggml_threads import CalibrationInterrupted
from ultrafast.executors.packed_linear import gemm_dtype
from ultrafast.executors.torch_embed import DTYPE_NAMES
from ultrafast.executors.wide_forward import unsupported
from ultrafast.model.config import ModelLoadError
from ultrafast.model.gguf_meta import read_gguf_metadata
from ultrafast.model.gguf_weights import gguf_model_config
from ultrafast.model.kv_budget import available_memory_bytes
from ultrafast.request import SamplingParams

WIDE_PASS_MODES = ("auto", "on", "off")
SHORT_CHUNK, LONG_CHUNK = 32, 256  # the two measured chunk lengths (tokens)
_REPEATS = 3
_MEMORY_SHARE = 0.25  # bf16 weights may take at most this share of the available memory
_ON_MIN_TOKENS = 16  # --wide-pass on where no crossover was measured
OFF_STATUS = "off (--wide-pass off): every pass runs on llama.cpp"
# the routing threshold where only decode steps measured faster: no chunk takes the wide path
# alone (a chunk joins a torch decode step, wide_exec._torch_rows)
DECODE_ONLY = 1 << 30


def unavailable(executor) -> str | None:
    """Why the wide path cannot run beside this executor, or None (no timing here)."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN"
    if executor.kv_cache_dtype not in ("f16", "f32"):
        return f"the KV cache is {executor.kv_cache_dtype} (the wide path writes f16/f32 rows)"
    meta = read_gguf_metadata(executor.gguf_path)
    try:  # the model's shape, from the header alone (the weights load by need)
        why = unsupported(gguf_model_config(meta))
    except ModelLoadError as exc:
        why = str(exc)
    if why:
        return f"the wide forward cannot run this model: {why}"
    dtype = gemm_dtype()[0]
    weight_bytes = dtype.itemsize * sum(math.prod(t.shape) for t in meta.tensors)
    available = available_memory_bytes()
    if available is not None and weight_bytes > available * _MEMORY_SHARE:
        return (
            f"its {DTYPE_NAMES[dtype]} weights ({weight_bytes / 2**20:.0f} MiB) would exceed "
            f"{_MEMORY_SHARE:.0%} of the available memory"
        )
    return None


def plan_wide_path(executor, mode: str, time_gemms: Callable[[Any], object] | None = None) -> str:
    """Set executor.wide / wide_min_tokens for `mode` at once (weights loaded, both paths
    timed in slot 0); return the status line. Serving does this by need (wide_lazy.py).
    `time_gemms(wide)` chooses the GEMM kernels (default: timed here; wide_lazy's takes an
    earlier start's choice from the cache)."""
    if mode == "off":
        return OFF_STATUS
    why = unavailable(executor)
    if why is None:
        from ultrafast.executors.wide_forward import WideForward, gemm_row_counts

        try:
            executor.wide = WideForward(executor.gguf_path, executor.max_model_len)
        except (ValueError, ModelLoadError) as exc:
            why = f"the wide forward cannot run this model: {exc}"
    if why is not None:
        if mode == "on":
            raise ValueError(f"--wide-pass on: not available: {why}")
        return f"off (not available: {why}): every pass runs on llama.cpp"
    # the GEMM kernels first: the decode timing below depends on them (float16 copies)
    executor.wide.warm_gemms(gemm_row_counts(executor.max_num_batched_tokens, executor.num_slots))
    if time_gemms is None:
        executor.wide.time_gemms()  # nothing serves beside it yet
    else:
        time_gemms(executor.wide)
    min_tokens, status = time_wide_path(executor, mode)
    min_tokens, status = with_decode(executor, min_tokens, status, executor.start_wide_decode())
    if min_tokens is None:
        executor.wide = None
    else:
        executor.wide_min_tokens = min_tokens
    return status


def with_decode(
    executor, min_tokens: int | None, status: str, decode_status: str
) -> tuple[int | None, str]:
    """The routing threshold and status line once the decode steps are timed too: the path
    stays on for its decode steps alone (DECODE_ONLY) where prefill chunks were not faster
    (`min_tokens` None) but decode steps were; off, its mirror and router are dropped."""
    if min_tokens is None and executor.decode_router.enabled:
        min_tokens = DECODE_ONLY
        why = status[status.find("(") + 1 : status.rfind(")")]  # "measured not faster: ..."
        status = (
            f"decode only: prefill chunks stay on llama.cpp ({why}) unless a torch decode step "
            "carries them"
        )
    if min_tokens is None:
        executor.mirror, executor.decode_router = None, type(executor.decode_router)(0)
        return None, f"{status}; {decode_status}"
    return min_tokens, f"{status}; {decode_status}; {executor.wide.kernels_status}"


def time_wide_path(
    executor, mode: str, slot: int = 0, should_stop: Callable[[], bool] = lambda: False
) -> tuple[int | None, str]:
    """With executor.wide loaded: time both paths in the empty `slot` and return the routing
    threshold (None: stay on llama.cpp) and the status line. `should_stop()` is asked between
    passes: True raises CalibrationInterrupted (the slot left empty)."""
    long_chunk = min(LONG_CHUNK, executor.max_num_batched_tokens, executor.max_model_len - 1)
    short_chunk = min(SHORT_CHUNK, long_chunk // 2)
    if short_chunk < 2:
        return None, "off (passes of at most a few tokens): every pass runs on llama.cpp"
    timings = {n: measure_chunk(executor, n, slot, should_stop) for n in (short_chunk, long_chunk)}
    crossover = crossover_tokens(timings)
    shown = ", ".join(
        f"{n} tokens {ggml * 1e3:.0f} ms llama.cpp / {wide * 1e3:.0f} ms wide"
        for n, (ggml, wide) in timings.items()
    )
    if crossover is None and mode == "auto":
        return None, f"off (measured not faster: {shown}): every pass runs on llama.cpp"
    min_tokens = crossover or _ON_MIN_TOKENS
    return min_tokens, (
        f"on ({mode}): prefill chunks of >= {min_tokens} tokens run as PyTorch passes "
        f"with {gemm_dtype()[1]} GEMMs, the rest on llama.cpp (measured: {shown})"
    )


def crossover_tokens(timings: dict[int, tuple[float, float]]) -> int | None:
    """The chunk length from which the wide path is cheaper, from (llama.cpp, wide) seconds at
    two lengths joined by straight lines; None when it is not cheaper at the longer one."""
    (short, (g_s, w_s)), (long, (g_l, w_l)) = sorted(timings.items())
    if w_l >= g_l:
        return None
    if w_s <= g_s:
        return short
    gain_s, gain_l = g_s - w_s, g_l - w_l  # negative, then positive
    return math.ceil(short + (long - short) * -gain_s / (gain_l - gain_s))


def measure_chunk(
    executor, num_tokens: int, slot: int = 0, should_stop: Callable[[], bool] = lambda: False
) -> tuple[float, float]:
    """Seconds of one prefill chunk of `num_tokens` tokens (the last one sampled) in `slot` on
    llama.cpp alone and on the wide path, the fastest of a few (other load only adds time);
    the slot is left empty."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = [(i * 31 + 7) % executor.vocab_size for i in range(num_tokens)]
    plan = StepPlan([ScheduledSeq("wide-calibration", slot, prompt, 0, 1, greedy, 0, 0)])
    saved = executor.wide_min_tokens

    def use(wide: bool) -> None:
        executor._wide_paused = not wide
        executor.wide_min_tokens = 2

    try:
        return time_both_paths(executor, plan, use, _REPEATS, "wide-pass calibration", should_stop)
    finally:
        executor._wide_paused = False
        executor.wide_min_tokens = saved
        executor._trim_slot(slot, 0)


def time_both_paths(
    executor,
    plan: StepPlan,
    use,
    repeats: int,
    what: str,
    should_stop: Callable[[], bool] = lambda: False,
) -> tuple[float, float]:
    """Seconds of `plan` with use(False) then use(True) in force, interleaved (a load change
    hits both paths), the fastest of `repeats` after a warm-up round (other load only adds
    time): (llama.cpp, wide). An arriving request (`should_stop`) interrupts it."""
    timings: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats + 1):
        for wide in (False, True):
            if should_stop():
                raise CalibrationInterrupted
            use(wide)
            start_s = time.perf_counter()
            result = executor.execute(plan)
            timings[wide].append(time.perf_counter() - start_s)
            if result.errors:
                raise RuntimeError(f"{what} failed: {result.errors}")
    return min(timings[False][1:]), min(timings[True][1:])
