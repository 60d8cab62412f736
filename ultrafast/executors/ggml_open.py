"""Opening a llama.cpp model and its serving context: the ggml executor's first step, which
`serve` may start early on a thread of its own (ultrafast/early_open.py) and the executor
then adopts.

llama.cpp's model load and context creation (which clears every slot's KV) take most of a
second for the default model, in C through ctypes, which releases the GIL: on a thread of their
own they run beside the Python imports of the server, the engine and torch. `LlamaOpen` holds
what they made; `GgmlExecutor` opens one itself (`open_llama`) unless `adopt` hands it the one
opened early with exactly its parameters (`OpenParams`). This module imports llama.cpp only,
so an early open does not wait for the engine's imports.

The KV memory that the context creation zeroed goes back to the kernel (ggml_memory.py). That
release must not run while another thread could write memory without the GIL, so it is the
executor's constructor that makes it, on the thread that builds the engine, when an early
open's thread has ended (and only where the ranges are still mapped: ggml_memory.py).
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from ultrafast.executors import ggml_memory
from ultrafast.executors.llama_cpp_params import model_params as llama_model_params
from ultrafast.model.config import ModelLoadError

_LOG_LEVEL_ERROR = 4  # ggml_log_level: 3 is WARN, 4 ERROR, 5 CONT
_LOG_LEVEL_CONT = 5
KV_CACHE_DTYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type ids of the K/V cache tensors


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
_native_lock = threading.Lock()


def _init_native(verbose: bool) -> _NativeLog:
    global _native_log
    with _native_lock:  # an early open and the engine's thread may both get here
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


@dataclass(frozen=True)
class OpenParams:
    """Everything the model and context are made from: an early open is adopted only by an
    executor asking for exactly these."""

    gguf_path: str
    num_slots: int
    max_model_len: int
    n_threads: int
    n_threads_batch: int
    max_num_batched_tokens: int
    kv_cache_dtype: str = "f16"
    flash_attn: bool = False
    weights_path: str = ""  # the file llama.cpp loads, when not gguf_path (f16_twin.py)

    @classmethod
    def of(
        cls,
        gguf_path: str | Path,
        num_slots: int,
        max_model_len: int,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        max_num_batched_tokens: int = 512,
        kv_cache_dtype: str = "f16",
        flash_attn: bool = False,
        weights_path: str | Path | None = None,
    ) -> OpenParams:
        """The executor's constructor arguments, its thread defaults applied."""
        threads = n_threads or physical_cores()
        return cls(
            str(gguf_path),
            num_slots,
            max_model_len,
            threads,
            n_threads_batch or threads,
            max_num_batched_tokens,
            kv_cache_dtype,
            flash_attn,
            str(weights_path) if weights_path and Path(weights_path) != Path(gguf_path) else "",
        )

    def context_params(self):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.num_slots * self.max_model_len
        params.n_batch = params.n_ubatch = self.max_num_batched_tokens
        params.n_seq_max = self.num_slots
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
        params.type_k = params.type_v = KV_CACHE_DTYPES[self.kv_cache_dtype]
        params.no_perf = True
        return params


class LlamaOpen:
    """A loaded llama.cpp model and its context, until an executor takes them (or `close`)."""

    def __init__(self, params: OpenParams, log: _NativeLog):
        self.params, self.log = params, log
        self.model = self.ctx = None
        self.architecture = ""
        # the mappings that appeared while the context was made: its zeroed KV among them
        self._new_ranges: list[tuple[int, int]] = []
        self.released_bytes = 0

    def release_zero_pages(self) -> int:
        """The KV pages the context creation zeroed go back to the kernel (once)."""
        ranges, self._new_ranges = self._new_ranges, []
        # only what is still mapped: another thread may have unmapped a range since
        self.released_bytes += ggml_memory.release_zero_pages(ggml_memory.still_mapped(ranges))
        return self.released_bytes

    def close(self) -> None:
        """Free the context, then the model. Safe to call more than once."""
        ggml_memory.closed(self)
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
        if self.model:
            llama_cpp.llama_model_free(self.model)
        self.ctx = self.model = None


def open_llama(params: OpenParams, verbose: bool = False) -> LlamaOpen:
    """Load the model and create the serving context; ModelLoadError says why not. The
    zeroed KV is released by the executor that takes it (`LlamaOpen.release_zero_pages`)."""
    opened = LlamaOpen(params, _init_native(verbose))
    try:
        _load_model(opened)
        _create_context(opened)
    except BaseException:
        opened.close()
        raise
    return opened


def _load_model(opened: LlamaOpen) -> None:
    params = opened.params
    path = params.weights_path or params.gguf_path
    model_params = llama_model_params()
    model_params.n_gpu_layers = 0
    opened.model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
    if not opened.model:
        reason = opened.log.take_errors() or "no reason given"
        raise ModelLoadError(f"llama.cpp could not load {path}: {reason}")
    # Sizes come from llama.cpp, whatever the architecture: our own model code is not asked
    opened.architecture = _meta_str(opened.model, "general.architecture")
    n_ctx_train = llama_cpp.llama_model_n_ctx_train(opened.model)
    problem = _unservable(opened.model, opened.architecture, params.max_model_len, n_ctx_train)
    if problem:
        raise ModelLoadError(f"{path}: {problem}")


def _create_context(opened: LlamaOpen) -> None:
    params = opened.params
    before = ggml_memory.opening(opened)
    opened.ctx = llama_cpp.llama_init_from_model(opened.model, params.context_params())
    opened._new_ranges = ggml_memory.new_since(before)  # compared and released later
    if not opened.ctx:
        raise ModelLoadError(
            f"llama.cpp could not create a context (num_slots={params.num_slots}, "
            f"max_model_len={params.max_model_len}): {opened.log.take_errors()}"
        )


class EarlyOpen:
    """`open_llama` run early on another thread (ultrafast/early_open.py's), for an executor to
    adopt: registered first (`register_early`), then `run` on that thread."""

    def __init__(self, params: OpenParams):
        self.params = params
        self.opened: LlamaOpen | None = None
        self._done = threading.Event()

    def run(self) -> None:
        try:
            self.opened = open_llama(self.params)
        except Exception:  # the executor opens again itself, and reports the failure
            self.opened = None
        finally:
            self._done.set()

    def result(self) -> LlamaOpen | None:
        self._done.wait()
        return self.opened


_early: EarlyOpen | None = None
_early_lock = threading.Lock()


def register_early(params: OpenParams) -> EarlyOpen:
    """An early open of `params`, to be run on the caller's thread; it replaces any other."""
    global _early
    discard_early()
    early = EarlyOpen(params)
    with _early_lock:
        _early = early
    return early


def _take_early() -> EarlyOpen | None:
    global _early
    with _early_lock:
        early, _early = _early, None
    return early


def adopt(params: OpenParams) -> LlamaOpen | None:
    """The early open if it was made with exactly `params` (waiting for it to finish); any
    other early open is closed first, so the caller's own open is alone (ggml_memory)."""
    early = _take_early()
    opened = early.result() if early is not None else None
    if opened is not None and early is not None and early.params == params:
        return opened
    if opened is not None:
        opened.close()
    return None


def discard_early() -> None:
    """Close an early open that no executor adopted (its model was not served after all)."""
    early = _take_early()
    opened = early.result() if early is not None else None
    if opened is not None:
        opened.close()
