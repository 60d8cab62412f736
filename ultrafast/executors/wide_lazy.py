"""The wide path by need: nothing of it at start but feature detection, its bf16 weights loaded
on the first prefill chunk long enough to use it, its routing timed while the engine is idle.

Why: loading the bf16 copy of the weights and timing both paths took ~7 s and ~370 MiB before
the first answer on the default model, for a path only long prompts use. Now:

- at start, `unavailable()` (oneDNN, bf16, KV type, the model's shape from the GGUF header,
  memory) says whether the path can run at all; a routing decision cached for this CPU,
  model file and flags (`start-costs/`, executors/cost_cache.py) is read;
- the first pass whose chunks long enough for the path (>= the cached threshold, or >=
  SHORT_CHUNK tokens when undecided) hold NEED_TOKENS tokens together (the long timing
  chunk's length: where the path's gain is measured; a chat question of 30-60 tokens is no
  need, its gain a few ms against ~370 MiB of weights on the default model, while a step of
  16 such prompts, or one long prompt, is) starts a background thread that builds the bf16
  weights at low CPU priority (a thread, not the engine thread: the dequantization takes
  seconds on a large model, and passes keep running meanwhile; at nice 10 it yields the cores
  to the engine's passes). With a cached decision that pass waits up to LOAD_WAIT_S for them
  and then takes the path: a small model's load (SmolLM2: 0.8-1.9 s on the 2-core AMX Xeon)
  costs less than the pass on llama.cpp beside the loader (a served 16-stream step of 512
  prompt tokens took 2.5 s, then every slot's KV had to be pulled into the torch mirror).
  Otherwise, and past the wait, passes run on llama.cpp until the path is ready;
- a cached decision applies when the weights are in; otherwise both paths are timed when the
  engine is next idle (engine/start_costs.py's idle tick), in a slot that holds nothing,
  giving way to any request that arrives; the decision is cached, and where the wide path is
  not faster its weights are dropped again.

Offline users (LLM, in-process benchmarks) decide at once (`decide_now`) unless cached.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ultrafast.core.types import StepPlan
from ultrafast.cpu_info import cpu_identity
from ultrafast.executors.cost_cache import read_cache, write_cache
from ultrafast.executors.wide_decode import attention_choice
from ultrafast.executors.wide_route import (
    DECODE_ONLY,
    LONG_CHUNK,
    OFF_STATUS,
    SHORT_CHUNK,
    plan_wide_path,
    time_wide_path,
    unavailable,
    with_decode,
)
from ultrafast.heap_trim import glibc_trim

log = logging.getLogger("ultrafast.executors.wide_exec")

LOADER_NICE = 10  # the weight loader's niceness: the engine's passes come first
LOAD_WAIT_S = 3.0  # the needing pass waits this long for the weights of a cached decision
NEED_TOKENS = LONG_CHUNK  # routable prefill tokens in one pass that make the path needed


# raised when a change moves the wide path's speed (2: packed oneDNN weights, grouped decode
# attention; 3: prefill attention as bf16 GEMMs; 4: the C decode attention kernel, prefill and
# decodes in one pass; 5: the fused elementwise C ops; 6: the AMX prefill attention kernel;
# 7: float32 GEMMs packed, float32 activations where the GEMMs are float32; 8: float16 weight
# copies for few-row GEMMs, GEMMs timed before the paths, the path on for decode steps alone):
# routing decisions cached by an earlier revision are timed again
WIDE_PATH_REVISION = 8


class WideLazy:
    """The wide path's state beside one WideGgmlExecutor: off, by need (weights not loaded),
    loading, untimed (waits for an idle engine), or on."""

    def __init__(self, executor: Any, mode: str) -> None:
        self.ex, self.mode = executor, mode
        self.state = "off"
        self.status = OFF_STATUS
        self.armed = True  # False while the engine times its own start costs
        self.min_tokens: int | None = None  # the cached routing threshold, if any
        self.decode_width = 0  # the cached width from which decode steps run in torch
        self.decode_from_positions: dict[int, int] = {}  # ... and at longer contexts
        self._loader: threading.Thread | None = None
        self._loaded: Any = None  # the WideForward, once built
        self._load_error: str | None = None
        if mode == "off":
            return
        why = unavailable(executor)
        if why is not None:
            if mode == "on":
                raise ValueError(f"--wide-pass on: not available: {why}")
            self.status = f"off (not available: {why}): every pass runs on llama.cpp"
            return
        self.state = "by need"
        cached = read_cache(self.identity())
        if cached is not None and "wide_min_tokens" in cached:
            self.min_tokens = cached["wide_min_tokens"]
            self.decode_width = int(cached.get("decode_on_width") or 0)
            longer = cached.get("decode_from_positions") or {}
            self.decode_from_positions = {int(w): int(p) for w, p in longer.items()}
            if self.min_tokens is None:
                self.state = "off"
                self.status = f"{cached.get('status', 'off')} (cached)"
                return
        self.status = self._by_need_status(cached is not None)

    def identity(self) -> dict:
        ex = self.ex
        return {
            "cache": "wide_pass+decode",  # the decode width joined the decision
            "revision": WIDE_PATH_REVISION,
            "mode": self.mode,
            "torch": torch.__version__,
            "threads": [ex.n_threads, ex.n_threads_batch, getattr(ex, "threads_auto", False)],
            **cpu_identity(),
            **ex.cost_identity(),
        }

    def _by_need_status(self, cached: bool) -> str:
        routing = "routing timed when the engine is idle"
        if cached:
            routing = (
                "routing cached: decode steps only"
                if self.min_tokens == DECODE_ONLY
                else f"routing cached: chunks of >= {self.min_tokens} tokens"
            )
        return (
            f"by need: weights load at the first pass with >= {NEED_TOKENS} prompt tokens "
            f"in chunks of >= {self.threshold} ({routing}); until then every pass runs on "
            "llama.cpp"
        )

    @property
    def threshold(self) -> int:
        """The chunk length from which a pass needs the wide path (for its decode steps
        alone, DECODE_ONLY: a pass of many prompts, whose decodes come next)."""
        if self.min_tokens is None or self.min_tokens == DECODE_ONLY:
            return SHORT_CHUNK
        return self.min_tokens

    # ---- on the engine thread, before a pass on llama.cpp ----

    def on_pass(self, plan: StepPlan) -> None:
        """Start loading at the first chunk that needs the path; take the weights once in."""
        if self.state == "by need" and self.armed:
            lengths = (len(s.token_ids) for s in plan.seqs)
            routable = sum(n for n in lengths if n >= self.threshold)
            if routable >= NEED_TOKENS:
                self._start_loading(routable)
                if self.min_tokens is not None and self._loader is not None:
                    self._loader.join(LOAD_WAIT_S)  # the decision is known: wait, then use it
        self.poll()

    def poll(self) -> None:
        """Take the weights once the loader is done (engine thread: passes or idle ticks)."""
        if self.state == "loading" and self._loader is not None and not self._loader.is_alive():
            self._take_loaded()

    def _start_loading(self, tokens: int) -> None:
        self.state = "loading"
        self.status = "loading the weights in the background; passes run on llama.cpp meanwhile"
        log.info("wide passes: a pass of %d prompt tokens needs them: %s", tokens, self.status)
        self._loader = threading.Thread(target=self._load, name="wide-weights", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        from ultrafast.executors.wide_forward import WideForward, gemm_row_counts

        try:  # a thread's own niceness on Linux; torch's pool threads made here inherit it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICE)
        except (OSError, AttributeError):
            pass
        started = time.monotonic()
        try:
            forward = WideForward(self.ex.gguf_path, self.ex.max_model_len)
        except Exception as exc:  # noqa: BLE001 - any failure leaves llama.cpp serving
            self._load_error = f"{type(exc).__name__}: {exc}"
            return
        # the decode attention kernel built and timed here too, off the engine thread, and
        # oneDNN's primitives for every row count a step can have
        attention_choice(forward.heads, forward.kv_heads, forward.head_dim)
        glibc_trim()  # the load's transients (heap_trim.py: SmolLM2 f32, steady 2.5 -> 1.6 GiB)
        try:  # a speed-up only: the passes build what they meet if this fails
            forward.warm_gemms(gemm_row_counts(self.ex.max_num_batched_tokens, self.ex.num_slots))
            self._reuse_gemms(forward)
        except Exception as exc:  # noqa: BLE001
            log.warning("wide passes: GEMM row counts not built ahead (%s)", exc)
        glibc_trim()
        self._loaded = forward
        from ultrafast.executors.packed_linear import gemm_dtype, pack_support

        why_plain = pack_support(gemm_dtype()[0])
        layout = "packed for oneDNN" if why_plain is None else f"plain: {why_plain}"
        log.info(
            "wide passes: weights built in %.1f s (%s GEMMs; %s)",
            time.monotonic() - started,
            gemm_dtype()[1],
            layout,
        )

    def _take_loaded(self) -> None:
        self._loader = None
        if self._loaded is None:
            self.state = "off"
            self.status = f"off (the weights did not load: {self._load_error})"
            log.warning("wide passes: %s: every pass runs on llama.cpp", self.status)
            return
        if self.min_tokens is not None:  # decided before: no timing
            self._turn_on(self._loaded, self.min_tokens, f"{self._cached_on_status()}")
        else:
            self.state = "untimed"
            self.status = "weights loaded; timing both paths when the engine is next idle"
            log.info("wide passes: %s", self.status)

    def _cached_on_status(self) -> str:
        if self.min_tokens == DECODE_ONLY:
            return (
                f"decode only ({self.mode}, routing cached): prefill chunks run in torch only "
                "within its decode steps"
            )
        return (
            f"on ({self.mode}, routing cached): prefill chunks of >= {self.min_tokens} tokens "
            "run as PyTorch passes, the rest on llama.cpp"
        )

    def _turn_on(self, forward: Any, min_tokens: int, status: str, timed: bool = False) -> None:
        self.ex.wide, self.ex.wide_min_tokens = forward, min_tokens
        if not timed:  # a cached decision: the decode width comes from the cache too
            self.ex.use_wide_decode(self.decode_width, self.decode_from_positions)
            status += "; " + forward.kernels_status  # (a timed status, as cached, says it)
        if self.ex.decode_router.enabled:
            status += "; " + attention_choice(forward.heads, forward.kv_heads, forward.head_dim)[1]
        self._loaded, self.state, self.status = None, "on", status
        log.info("wide passes: %s", status)

    # ---- on the engine thread, while it is idle ----

    def wants_time(self) -> bool:
        self.poll()
        return self.state == "untimed" or self._gemms_untimed()

    def _forward(self) -> Any:
        """The weights being timed or served (None: off, by need or loading)."""
        return {"on": self.ex.wide, "untimed": self._loaded}.get(self.state)

    def _gemms_untimed(self) -> bool:
        forward = self._forward()
        return forward is not None and forward.gemms_due()

    def time_now(self, free_slots: list[int], should_stop: Callable[[], bool]) -> bool:
        """Time both paths in one of `free_slots` (the pool's: no owner, no cached prefix) and
        decide; False when there is none. An arriving request interrupts it
        (CalibrationInterrupted, raised): it is timed again later. With the path on, time
        its GEMMs' kernels instead (WideForward.time_gemms), giving way to requests in the
        same way."""
        if self._gemms_untimed():  # first: the decode timing depends on the kernels chosen
            forward = self._forward()
            untimed = forward.gemm_status
            if forward.time_gemms(should_stop):  # the status says the choice from now
                self._cache_gemms(forward)
                self.status = self.status.replace(untimed, forward.gemm_status)
                log.info("wide passes: %s", forward.gemm_status)
                glibc_trim()  # the freed copies and the timing's products
            return True
        if not free_slots:  # (their stale KV, if any, is the pool's to overwrite)
            return False
        slot = free_slots[-1]  # the last: the pool hands out the first ones first
        self.ex.wide = self._loaded
        try:
            min_tokens, status = time_wide_path(self.ex, self.mode, slot, should_stop)
            # decode steps: timed in the free slots too (the path may be on for them alone)
            decode_status = self.ex.start_wide_decode(free_slots, should_stop)
            min_tokens, status = with_decode(self.ex, min_tokens, status, decode_status)
        finally:
            self.ex.wide = None
        self._remember(min_tokens, status)
        if min_tokens is None:  # not faster here: the weights go again
            self._loaded, self.state, self.status = None, "off", status
            log.info("wide passes: %s", status)
        else:
            self._turn_on(self._loaded, min_tokens, status, timed=True)
        return True

    # ---- the GEMM kernels' choice, cached apart from the routing ----

    def gemm_identity(self, row_counts: list[int]) -> dict:
        """The cache key of the GEMM choices: the routing's, and the row counts timed."""
        return {**self.identity(), "cache": "wide_gemms", "row_counts": list(row_counts)}

    def _reuse_gemms(self, forward: Any) -> bool:
        """An earlier start's GEMM choices for this CPU, file, flags and row counts, taken
        instead of timing them (WideForward.use_kernel_choices); False where none is cached."""
        cached = read_cache(self.gemm_identity(forward.gemm_rows))
        if cached is None or not forward.use_kernel_choices(cached.get("kernels")):
            return False
        log.info("wide passes: %s", forward.gemm_status)
        return True

    def _cache_gemms(self, forward: Any) -> None:
        write_cache(self.gemm_identity(forward.gemm_rows), {"kernels": forward.kernel_choices()})

    def _time_or_reuse_gemms(self, forward: Any) -> None:
        """plan_wide_path's GEMM step offline: the cached choices, else timed and cached."""
        if not self._reuse_gemms(forward) and forward.time_gemms():
            self._cache_gemms(forward)

    def _remember(self, min_tokens: int | None, status: str) -> None:
        router = self.ex.decode_router
        on = min_tokens is not None
        self.decode_width = router.on_width if on else 0
        self.decode_from_positions = dict(router.from_positions) if on else {}
        decision = {
            "wide_min_tokens": min_tokens,
            "decode_on_width": self.decode_width,
            "decode_from_positions": {str(w): p for w, p in self.decode_from_positions.items()},
            "status": status,
        }
        write_cache(self.identity(), decision)

    # ---- offline (no idle engine thread to time on) ----

    def decide_now(self, use_cache: bool = True) -> None:
        """Load and time at once (in slot 0, on an executor that serves nothing yet) where no
        decision is cached or `use_cache` is False; a cached decision still loads by need."""
        if self.state != "by need" or (use_cache and self.min_tokens is not None):
            return
        self.status = plan_wide_path(self.ex, self.mode, self._time_or_reuse_gemms)
        self.state = "on" if self.ex.wide is not None else "off"
        glibc_trim()
        if self.ex.wide is not None:
            self.min_tokens = self.ex.wide_min_tokens
        min_tokens = self.min_tokens if self.ex.wide is not None else None
        self._remember(min_tokens, self.status)
        log.info("wide passes: %s", self.status)

    def wait_loaded(self, timeout_s: float | None = None) -> None:
        """Block until a background load started by on_pass ends (tests, benchmarks)."""
        if self._loader is not None:
            self._loader.join(timeout_s)

    def loading(self) -> bool:
        """Whether a background load is running now."""
        return self._loader is not None and self._loader.is_alive()
