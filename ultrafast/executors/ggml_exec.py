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

import ctypes
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import numpy as np

from ultrafast.core.types import ScheduledSeq, StepPlan, StepResult
from ultrafast.executors import ggml_calibration, ggml_kv_rows, ggml_open, ggml_state
from ultrafast.executors.base import ExecutorCaps
from ultrafast.executors.ggml_open import (
    KV_CACHE_DTYPES,
    LlamaOpen,
    OpenParams,
    _init_native,
    open_llama,
    physical_cores,
)
from ultrafast.executors.ggml_threads import THREAD_MARGIN, ThreadPlan
from ultrafast.executors.llama_cpp_params import NumpyBatch
from ultrafast.executors.prompt_scoring import scoring_problem, split_prompt_rows
from ultrafast.kvcache.fingerprint import file_sha256, kv_fingerprint
from ultrafast.sampling.sampler import sample_keeping_deferred, sample_kept_row

# llama_get_logits with an integer restype: the binding's POINTER(c_float) result costs a cast
_llama_get_logits = ctypes.cast(llama_cpp.llama_get_logits, ctypes.c_void_p).value
if _llama_get_logits is None:
    raise ImportError("the loaded libllama has no llama_get_logits")
_get_logits_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(_llama_get_logits)


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
        weights_path: str | Path | None = None,
        verbose: bool = False,
    ) -> None:
        """`weights_path`: the file llama.cpp loads when not `gguf_path` itself (an exact
        float16 copy of a bf16 file: f16_twin.py); `gguf_path` stays the model's identity."""
        self._ctx = self._model = None  # close() / __del__ work however far __init__ gets
        self._opened: LlamaOpen | None = None
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}")
        if num_slots < 1 or max_model_len < 1 or max_num_batched_tokens < 1:
            raise ValueError("num_slots, max_model_len and max_num_batched_tokens must be >= 1")
        if not Path(gguf_path).is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.gguf_path = Path(gguf_path)
        self.weights_path = Path(weights_path) if weights_path else self.gguf_path
        self.kv_cache_dtype, self.flash_attn = kv_cache_dtype, flash_attn
        self.n_threads = n_threads or physical_cores()
        self.n_threads_batch = n_threads_batch or self.n_threads
        # threads per pass width measured at start (calibrate_threads), when none were given
        self.threads_auto = threads_auto
        self.thread_plan: ThreadPlan | None = None
        self._threads_now = (self.n_threads, self.n_threads_batch)
        self._log = _init_native(verbose)
        params = OpenParams.of(
            gguf_path,
            num_slots,
            max_model_len,
            self.n_threads,
            self.n_threads_batch,
            max_num_batched_tokens,
            kv_cache_dtype,
            flash_attn,
            weights_path,
        )
        # opened early by `serve` (ultrafast/early_open.py) with exactly these parameters, or now
        self._opened = ggml_open.adopt(params) or open_llama(params, verbose)
        self._model, self._ctx = self._opened.model, self._opened.ctx
        # the KV llama.cpp just zeroed goes back to the kernel until a slot writes it
        self.released_bytes = self._opened.release_zero_pages()
        # Sizes come from llama.cpp, whatever the architecture: our own model code is not asked
        self.architecture = self._opened.architecture
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(
            llama_cpp.llama_model_get_vocab(self._model)
        )
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self._model)
        self.n_layer = llama_cpp.llama_model_n_layer(self._model)
        self.n_embd = llama_cpp.llama_model_n_embd(self._model)
        # a KV stream per slot, and llama.cpp then splits a step into ubatches of equal tokens
        # per sequence: one forward pass per distinct length (decodes + a prefill = 2 passes)
        self.one_pass_per_length = num_slots > 1
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
        """dst := src's KV at [0, num_tokens). Across slots, the prefix's cells through the
        state API (`_copy_cells`); where that cannot read or write them (a quantized cache),
        llama.cpp's own copy of the whole sequence, whose tail is then dropped."""
        memory = self._memory
        num_tokens = min(num_tokens, self._slot_lens[src_slot_id])
        if src_slot_id != dst_slot_id:
            if self._copy_cells(src_slot_id, dst_slot_id, num_tokens):
                return
            llama_cpp.llama_memory_seq_rm(memory, dst_slot_id, -1, -1)
            llama_cpp.llama_memory_seq_cp(memory, src_slot_id, dst_slot_id, -1, -1)
        llama_cpp.llama_memory_seq_rm(memory, dst_slot_id, num_tokens, -1)
        self._slot_lens[dst_slot_id] = num_tokens

    def _copy_cells(self, src_slot_id: int, dst_slot_id: int, num_tokens: int) -> bool:
        """Export src, keep its cells [0, num_tokens), import them into dst: True once done.

        Why not `llama_memory_seq_cp`: across KV streams (one a slot) llama.cpp copies the
        whole stream buffer at the next decode, every layer's 2,048 cells (45 MiB a slot for
        SmolLM2), to share a 24-token system prompt: a 50-340 ms first decode after it on the
        2-core AMX Xeon (2-5 ms this way for sources of 100-230 cells). The export reads src's
        own cells only."""
        if num_tokens <= 0:
            return False
        try:
            rows = ggml_kv_rows.parse_chunk(
                ggml_state.export_slot(self._ctx, src_slot_id, self.num_slots)
            )
            chunk = ggml_kv_rows.build_chunk(ggml_kv_rows.prefix(rows, num_tokens))
            # llama.cpp's own import: a subclass's (wide_exec) also moves its mirror, which
            # its _copy_prefix does itself around this one
            GgmlExecutor.import_slot(self, dst_slot_id, chunk, num_tokens)
        except (ValueError, RuntimeError):  # a layout this reader does not know: seq_cp
            llama_cpp.llama_memory_seq_rm(self._memory, dst_slot_id, -1, -1)
            self._slot_lens[dst_slot_id] = 0
            return False
        return True

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
        if self._opened is not None:
            self._opened.close()
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
