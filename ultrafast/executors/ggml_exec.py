"""The fast CPU executor: llama.cpp's kernels on a GGUF file, driven through llama-cpp-python's
low-level ctypes API (no `Llama` object, no llama.cpp sampler).

Owns one llama.cpp model + context. Each KV slot is a llama.cpp sequence id with its own KV
stream of `max_model_len` cells, so a step attends only to its own slots' cells (a unified pool
made every step attend over all resident cells: half speed for a lone stream on 16 slots). A
prefix copy (KVCopy) across slots copies the source sequence. A step is one `llama_decode` over
every scheduled sequence; the logits rows it asked for come back contiguous and in batch order,
which is exactly the layout `sample_plan` wants, so they are handed over as a zero-copy tensor
view.

The batch arrays are numpy buffers owned here (not `llama_batch_init`'s mallocs): one
contiguous array per field, so filling a step is a few slice assignments instead of a Python
loop per token, and each token's `seq_id` pointer points into one contiguous int32 array.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import numpy as np

from ultrafast.core.types import ScheduledSeq, StepPlan, StepResult
from ultrafast.executors import ggml_calibration, ggml_memory, ggml_state
from ultrafast.executors.base import ExecutorCaps
from ultrafast.executors.ggml_threads import THREAD_MARGIN, ThreadPlan
from ultrafast.executors.llama_cpp_params import NumpyBatch
from ultrafast.executors.llama_cpp_params import model_params as llama_model_params
from ultrafast.executors.prompt_scoring import scoring_problem, split_prompt_rows
from ultrafast.kvcache.fingerprint import file_sha256, kv_fingerprint
from ultrafast.model.config import ModelLoadError
from ultrafast.sampling.sampler import sample_keeping_deferred, sample_kept_row

_LOG_LEVEL_ERROR = 4  # ggml_log_level: 3 is WARN, 4 ERROR, 5 CONT
_LOG_LEVEL_CONT = 5
_KV_CACHE_DTYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type ids of the K/V cache tensors


class _NativeLog:
    """Process-wide llama.cpp/ggml log sink (llama.cpp has one global logger).

    Silent by default, but always remembers the last error lines so a failure can say why.
    The ctypes callback must stay referenced for as long as llama.cpp may call it.
    """

    def __init__(self) -> None:
        self.to_stderr = False
        self.errors: collections.deque[str] = collections.deque(maxlen=8)
        self._last_level = 0
        self.callback = llama_cpp.llama_log_callback(self._on_log)
        llama_cpp.llama_log_set(self.callback, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, _user_data) -> None:
        level = self._last_level if level == _LOG_LEVEL_CONT else level
        self._last_level = level
        message = text.decode("utf-8", errors="replace") if text else ""
        if level == _LOG_LEVEL_ERROR:
            self.errors.append(message.strip())
        if self.to_stderr:
            sys.stderr.write(message)

    def take_errors(self) -> str:
        text = " | ".join(line for line in self.errors if line)
        self.errors.clear()
        return text


_native_log: _NativeLog | None = None

# llama_get_logits with an integer restype: the binding's POINTER(c_float) result costs a cast
_llama_get_logits = ctypes.cast(llama_cpp.llama_get_logits, ctypes.c_void_p).value
if _llama_get_logits is None:
    raise ImportError("the loaded libllama has no llama_get_logits")
_get_logits_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(_llama_get_logits)


def _init_native(verbose: bool) -> _NativeLog:
    global _native_log
    if _native_log is None:
        _native_log = _NativeLog()
        llama_cpp.llama_backend_init()
    _native_log.to_stderr = verbose
    return _native_log


def _meta_str(model, key: str) -> str:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", errors="replace") if n >= 0 else ""


def _unservable(model, arch: str, max_model_len: int, n_ctx_train: int) -> str | None:
    """Why this executor cannot serve a model llama.cpp loaded, or None. Never the architecture
    itself: only what our slot model needs (decoder-only, KV that can be cut at a position)."""
    if llama_cpp.llama_model_has_encoder(model):
        return f"{arch!r} is an encoder-decoder model; only decoder-only models are served"
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return (
            f"{arch!r} keeps a recurrent state, which cannot be rolled back to a position "
            "(prefix caching and speculation need that); it is not served yet"
        )
    # learned position embeddings (no RoPE) have no row past the trained context
    if llama_cpp.llama_model_rope_type(model) < 0 and 0 < n_ctx_train < max_model_len:
        return (
            f"{arch!r} has no RoPE and was trained on {n_ctx_train} positions; "
            f"--max-model-len {max_model_len} exceeds them"
        )
    return None


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyperthreads slow ggml down)."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                (
                    (topology / "physical_package_id").read_text().strip(),
                    (topology / "core_id").read_text().strip(),
                )
            )
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def _slot_of(seq: ScheduledSeq) -> int:
    return seq.slot_id


class GgmlExecutor:
    """Executor on llama.cpp. `max_num_batched_tokens` bounds the tokens of one step."""

    def __init__(
        self,
        gguf_path: str | Path,
        num_slots: int,
        max_model_len: int,
        n_threads: int | None = None,
        *,
        n_threads_batch: int | None = None,
        threads_auto: bool = False,
        max_num_batched_tokens: int = 512,
        kv_cache_dtype: str = "f16",
        flash_attn: bool = False,
        verbose: bool = False,
    ) -> None:
        self._ctx = self._model = None  # close() / __del__ work however far __init__ gets
        if kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(_KV_CACHE_DTYPES)}")
        if num_slots < 1 or max_model_len < 1 or max_num_batched_tokens < 1:
            raise ValueError("num_slots, max_model_len and max_num_batched_tokens must be >= 1")
        if not Path(gguf_path).is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.gguf_path = Path(gguf_path)
        self.kv_cache_dtype, self.flash_attn = kv_cache_dtype, flash_attn
        self.n_threads = n_threads or physical_cores()
        self.n_threads_batch = n_threads_batch or self.n_threads
        # threads per pass width measured at start (calibrate_threads), when none were given
        self.threads_auto = threads_auto
        self.thread_plan: ThreadPlan | None = None
        self._threads_now = (self.n_threads, self.n_threads_batch)
        self._log = _init_native(verbose)

        model_params = llama_model_params()
        model_params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), model_params)
        if not self._model:
            reason = self._log.take_errors() or "no reason given"
            raise ModelLoadError(f"llama.cpp could not load {gguf_path}: {reason}")
        # Sizes come from llama.cpp, whatever the architecture: our own model code is not asked
        self.architecture = _meta_str(self._model, "general.architecture")
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(
            llama_cpp.llama_model_get_vocab(self._model)
        )
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self._model)
        self.n_layer = llama_cpp.llama_model_n_layer(self._model)
        self.n_embd = llama_cpp.llama_model_n_embd(self._model)
        problem = _unservable(self._model, self.architecture, max_model_len, self.n_ctx_train)
        if problem:
            self.close()
            raise ModelLoadError(f"{gguf_path}: {problem}")

        params = self._context_params(num_slots, max_model_len, max_num_batched_tokens)
        # a KV stream per slot, and llama.cpp then splits a step into ubatches of equal tokens
        # per sequence: one forward pass per distinct length (decodes + a prefill = 2 passes)
        self.one_pass_per_length = num_slots > 1
        mappings = ggml_memory.opening(self)
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self._ctx:
            errors = self._log.take_errors()
            self.close()
            raise ModelLoadError(
                f"llama.cpp could not create a context "
                f"(num_slots={num_slots}, max_model_len={max_model_len}): {errors}"
            )
        # the KV llama.cpp just zeroed goes back to the kernel until a slot writes it
        self.released_bytes = ggml_memory.release_new_zero_pages(mappings)
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        # llama.cpp may clamp n_batch (e.g. to n_ctx); plans are checked against what it kept
        self.max_num_batched_tokens = min(
            max_num_batched_tokens, llama_cpp.llama_n_batch(self._ctx)
        )
        self._slot_lens = [0] * num_slots  # positions [0, len) of each slot hold KV
        self._logits_address = 0
        self._logits = np.empty((0, self.vocab_size), dtype=np.float32)
        self.last_logits = self._logits  # the last step's sampled rows (a view, valid until next)
        self._alloc_batch(max_num_batched_tokens)

    def _context_params(self, num_slots: int, max_model_len: int, max_batch: int):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = num_slots * max_model_len
        params.n_batch = params.n_ubatch = max_batch
        params.n_seq_max = num_slots
        # a KV stream per slot: a step attends only to the cells of its own slots. (One unified
        # pool let seq_cp share cells, but every step then attended over all resident cells,
        # prefix-cache leftovers of idle slots included: half speed for a lone stream.)
        params.kv_unified = False
        # llama.cpp runs a forward pass of one token on n_threads and any larger one (a
        # prefill chunk, a draft verification, several sequences' decodes) on n_threads_batch
        params.n_threads, params.n_threads_batch = self.n_threads, self.n_threads_batch
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if self.flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        # f32: exact vs torch
        params.type_k = params.type_v = _KV_CACHE_DTYPES[self.kv_cache_dtype]
        params.no_perf = True
        return params

    def _alloc_batch(self, capacity: int) -> None:
        self._numpy_batch = b = NumpyBatch(capacity, output_flags=0)
        self._tokens, self._positions, self._batch = b.tokens, b.positions, b.batch
        self._num_seq_ids, self._seq_ids, self._output_flags = (
            b.num_seq_ids,
            b.seq_ids,
            b.output_flags,
        )
        self._arange = np.arange(self.max_model_len + capacity, dtype=np.int32)

    def _check(self, seq: ScheduledSeq) -> str | None:
        """Why this sequence cannot run (it alone fails), or None."""
        ids, n = seq.token_ids, len(seq.token_ids)
        if not 0 <= seq.slot_id < self.num_slots:
            return f"slot_id {seq.slot_id} out of range [0, {self.num_slots})"
        if n == 0 or not 0 <= seq.num_logits <= n:
            return f"bad step: {n} tokens, num_logits={seq.num_logits}"
        if seq.start_position < 0 or seq.start_position + n > self.max_model_len:
            return (
                f"positions [{seq.start_position}, {seq.start_position + n}) exceed "
                f"max_model_len={self.max_model_len}"
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            return f"token id {bad} out of range [0, {self.vocab_size})"
        return scoring_problem(seq) if seq.num_prompt_logits else None

    def execute(self, plan: StepPlan) -> StepResult:
        start_s = time.perf_counter()
        for copy in plan.kv_copies:
            self._copy_prefix(copy.src_slot_id, copy.dst_slot_id, copy.num_tokens)
        errors: dict[str, str] = {}
        ran: list[ScheduledSeq] = []
        num_tokens = num_rows = num_scoring_rows = 0
        tokens, positions, seq_ids, flags = (
            self._tokens,
            self._positions,
            self._seq_ids,
            self._output_flags,
        )
        seqs = plan.seqs
        if len(seqs) > 1:
            # llama.cpp puts sequences in one forward pass only when their KV streams (our
            # slots) follow each other in batch order; any other order costs a pass per break
            seqs = sorted(seqs, key=_slot_of)
        for seq in seqs:
            n, start = len(seq.token_ids), seq.start_position
            error = self._check(seq)
            if error is None and num_tokens + n > self.max_num_batched_tokens:
                error = f"step exceeds max_num_batched_tokens={self.max_num_batched_tokens}"
            if error is None:
                error = self._trim_slot(seq.slot_id, start)
            if error is not None:
                errors[seq.request_id] = error
                continue
            if n == 1:  # the decode fast path: scalar stores beat slice assignment
                tokens[num_tokens] = seq.token_ids[0]
                positions[num_tokens] = start
                seq_ids[num_tokens] = seq.slot_id
                flags[num_tokens] = seq.num_logits or seq.num_prompt_logits
            else:
                end = num_tokens + n
                tokens[num_tokens:end] = seq.token_ids
                positions[num_tokens:end] = self._arange[start : start + n]
                seq_ids[num_tokens:end] = seq.slot_id
                flags[num_tokens : end - seq.num_logits] = 0
                flags[end - seq.num_logits : end] = 1
                if seq.num_prompt_logits:  # prompt scoring: those rows' logits too
                    flags[num_tokens : num_tokens + seq.num_prompt_logits] = 1
            num_tokens += n
            num_rows += seq.num_logits
            num_scoring_rows += seq.num_prompt_logits
            ran.append(seq)
        if num_tokens:
            self._decode(num_tokens, ran, plan.spare_threads)
        logits = self._logits_view(num_rows + num_scoring_rows)
        prompt_logprobs = {}
        if num_scoring_rows:
            logits, prompt_logprobs = split_prompt_rows(ran, logits)
        self.last_logits = logits  # the sampled rows: a draft model's q reads them
        sampled_s = time.perf_counter()
        result = sample_keeping_deferred(ran, logits) if num_rows else StepResult()
        result.prompt_logprobs = prompt_logprobs
        result.errors.update(errors)
        result.execute_time_s = sampled_s - start_s
        result.sample_time_s = time.perf_counter() - sampled_s
        return result

    def sample_kept(self, seq: ScheduledSeq, kept) -> StepResult:
        return sample_kept_row(seq, kept)

    def caps(self) -> ExecutorCaps:
        return ExecutorCaps(
            one_pass_per_length=self.one_pass_per_length,
            keeps_logits=True,
            thread_calibration=True,
            threads_auto=self.threads_auto,
            max_step_tokens=self.max_num_batched_tokens,
            last_logits=True,
        )

    def cost_identity(self) -> dict:
        """What the measured thread plan depends on besides the CPU (ggml_calibration.py)."""
        return ggml_calibration.cost_identity(self)

    def calibrate_threads(
        self,
        margin: float = THREAD_MARGIN,
        should_stop: Callable[[], bool] = lambda: False,
        free_slots: list[int] | None = None,
        progress: Callable[[int, int], None] = lambda done, total: None,
    ) -> ThreadPlan:
        """Time passes per width and thread count; keep and return the plan
        (ggml_calibration.py)."""
        return ggml_calibration.calibrate_executor(
            self, physical_cores(), margin, should_stop, free_slots, progress
        )

    def _set_threads(self, single: int, batch: int) -> None:
        if (single, batch) != self._threads_now:
            llama_cpp.llama_set_n_threads(self._ctx, single, batch)
            self._threads_now = (single, batch)

    def _decode(self, num_tokens: int, ran: list[ScheduledSeq], spare_threads: int = 0) -> None:
        plan = self.thread_plan
        if plan is not None:  # llama.cpp: 1-token passes on the first, larger on the second
            single, batch = plan.for_tokens(1), plan.for_tokens(num_tokens)
        else:
            single, batch = self.n_threads, self.n_threads_batch
        if spare_threads:
            single, batch = max(1, single - spare_threads), max(1, batch - spare_threads)
        self._set_threads(single, batch)
        self._batch.n_tokens = num_tokens
        status = llama_cpp.llama_decode(self._ctx, self._batch)
        if status != 0:
            self._resync_slot_lens()  # a fatal failure may leave some ubatches in the cache
            raise RuntimeError(
                f"llama_decode failed with status {status} on {num_tokens} "
                f"tokens of {len(ran)} sequences: {self._log.take_errors()}"
            )
        for seq in ran:
            self._slot_lens[seq.slot_id] = seq.start_position + len(seq.token_ids)

    def _copy_prefix(self, src_slot_id: int, dst_slot_id: int, num_tokens: int) -> None:
        """dst := src's KV at [0, num_tokens). Across KV streams llama.cpp copies a whole
        sequence (a buffer copy before the next decode); the tail is then dropped."""
        memory = self._memory
        if src_slot_id != dst_slot_id:
            llama_cpp.llama_memory_seq_rm(memory, dst_slot_id, -1, -1)
            llama_cpp.llama_memory_seq_cp(memory, src_slot_id, dst_slot_id, -1, -1)
        llama_cpp.llama_memory_seq_rm(memory, dst_slot_id, num_tokens, -1)
        self._slot_lens[dst_slot_id] = min(num_tokens, self._slot_lens[src_slot_id])

    def _trim_slot(self, slot_id: int, start_position: int) -> str | None:
        """Drop the slot's KV at >= start_position; the rest must be exactly [0, start_position).

        Slot lengths are mirrored in Python, so a plain decode step makes no native call here.
        """
        known = self._slot_lens[slot_id]
        if start_position > known:  # llama.cpp accepts a gap on an empty slot: refuse it here
            return f"slot {slot_id} holds {known} positions, cannot start at {start_position}"
        if start_position < known:
            llama_cpp.llama_memory_seq_rm(self._memory, slot_id, start_position, -1)
            self._slot_lens[slot_id] = start_position
        return None

    def _resync_slot_lens(self) -> None:
        self._slot_lens = [
            llama_cpp.llama_memory_seq_pos_max(self._memory, slot) + 1
            for slot in range(self.num_slots)
        ]

    def _logits_view(self, num_rows: int) -> np.ndarray:
        """The [num_rows, vocab] float32 logits of the last decode, without copying.

        Valid until the next decode; sample_plan is done with it before that. The numpy view is
        cached while llama.cpp keeps the same output buffer (it only reallocates to grow).
        """
        if num_rows == 0:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        address = _get_logits_address(self._ctx)
        if not address:
            raise RuntimeError(f"llama.cpp returned no logits: {self._log.take_errors()}")
        if address != self._logits_address or num_rows > self._logits.shape[0]:
            buffer = (ctypes.c_float * (num_rows * self.vocab_size)).from_address(address)
            self._logits = np.frombuffer(buffer, dtype=np.float32).reshape(
                num_rows, self.vocab_size
            )
            self._logits_address = address
        return self._logits if num_rows == self._logits.shape[0] else self._logits[:num_rows]

    # ---- KV export/import (kvcache/): one slot's state through llama.cpp's sequence API ----

    def kv_fingerprint(self) -> str:
        return kv_fingerprint(
            executor="ggml",
            model_sha256=file_sha256(self.gguf_path),
            kv_dtype=self.kv_cache_dtype,
            flash_attn=self.flash_attn,
            llama_cpp=llama_cpp.__version__,
        )

    def export_slot(self, slot_id: int, num_tokens: int) -> bytes:
        """The slot's KV (at least [0, num_tokens)) as a payload that fits any slot of any
        slot count."""
        if not 0 < num_tokens <= self._slot_lens[slot_id]:
            raise ValueError(f"slot {slot_id} holds {self._slot_lens[slot_id]} positions")
        return ggml_state.export_slot(self._ctx, slot_id, self.num_slots)

    def import_slot(self, slot_id: int, payload: bytes, num_tokens: int) -> None:
        """Replace the slot's KV with a payload's first `num_tokens` positions, or raise
        ValueError and leave the slot empty (the request then recomputes)."""
        memory = self._memory
        llama_cpp.llama_memory_seq_rm(memory, slot_id, -1, -1)
        self._slot_lens[slot_id] = 0
        try:
            ggml_state.import_slot(self._ctx, slot_id, self.num_slots, payload)
        except ValueError as exc:
            llama_cpp.llama_memory_seq_rm(memory, slot_id, -1, -1)
            raise ValueError(f"{exc}: {self._log.take_errors() or 'no native reason'}") from None
        held = llama_cpp.llama_memory_seq_pos_max(memory, slot_id) + 1
        if held < num_tokens or llama_cpp.llama_memory_seq_pos_min(memory, slot_id) > 0:
            llama_cpp.llama_memory_seq_rm(memory, slot_id, -1, -1)
            raise ValueError(f"KV payload holds {held} positions, {num_tokens} were expected")
        llama_cpp.llama_memory_seq_rm(memory, slot_id, num_tokens, -1)
        self._slot_lens[slot_id] = num_tokens

    def close(self) -> None:
        """Free the context, then the model. Safe to call more than once."""
        ggml_memory.closed(self)
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
        if self._model:
            llama_cpp.llama_model_free(self._model)
        self._ctx = self._model = None

    def __enter__(self) -> GgmlExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: llama_cpp may already be gone
            pass
