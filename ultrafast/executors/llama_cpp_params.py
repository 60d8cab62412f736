"""How every llama.cpp model here is loaded: our ggml executor, the llama.cpp peer, the tests.

llama.cpp's AMX weight buffers (an "extra buffer type" that repacks q8_0 / q4_0 weights for
Intel AMX tiles) die with SIGILL in the first pass on this project's AMX Xeons (llama-cpp-python
0.3.36, libggml-cpu 0.25.3; f16/bf16 models do not use them). Why, found with gdb and objdump:
the fault is the first `tileloadd` in `ggml_backend_amx_mul_mat`, and the library's only
`ldtilecfg` (in that function) loads a configuration with palette 1 and every tile's rows and
bytes per row zero, so no tile is usable. Not a permission problem: requesting AMX state with
arch_prctl(ARCH_REQ_XCOMP_PERM) first changes nothing, and oneDNN's AMX kernels (torch) run in
the same process. Where the CPU has AMX, models load without extra buffer types, so our executor
and the llama.cpp peer both run llama.cpp's plain AVX-512 kernels and stay comparable; the
matrix units are reached through oneDNN instead (wide_forward.py).
ULTRAFAST_GGML_EXTRA_BUFFERS=1 (or 0) forces the choice.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from functools import lru_cache

import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_lib
import numpy as np


@lru_cache(maxsize=1)
def extra_buffers_safe() -> bool:
    forced = os.environ.get("ULTRAFAST_GGML_EXTRA_BUFFERS")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True
    return "amx_int8" not in flags


def model_params():
    """`llama_model_default_params()`, less the extra buffer types where they crash."""
    params = _default_params()
    params.use_extra_bufts = params.use_extra_bufts and extra_buffers_safe()
    return params


_default_params = llama_cpp_lib.llama_model_default_params


@contextlib.contextmanager
def _patched_defaults():
    llama_cpp_lib.llama_model_default_params = model_params  # what Llama.__init__ calls
    try:
        yield
    finally:
        llama_cpp_lib.llama_model_default_params = _default_params


def open_llama(model_path: str, **kwargs) -> llama_cpp.Llama:
    """llama-cpp-python's high-level `Llama`, loaded with `model_params()`."""
    with _patched_defaults():
        return llama_cpp.Llama(model_path=str(model_path), **kwargs)


class NumpyBatch:
    """A llama_batch over numpy arrays that its owner fills in bulk (tokens, positions, one
    sequence id per token through `seq_ids`, output flags), as both our executors feed
    llama.cpp: no per-token Python object, and `batch.n_tokens` says how much is filled."""

    def __init__(self, capacity: int, output_flags: int):
        self.tokens = np.zeros(capacity, dtype=np.int32)
        self.positions = np.zeros(capacity, dtype=np.int32)
        self.num_seq_ids = np.ones(capacity, dtype=np.int32)  # each token in one sequence
        self.seq_ids = np.zeros(capacity, dtype=np.int32)
        # seq_id: one pointer per token, into `seq_ids`
        self.seq_id_ptrs = self.seq_ids.ctypes.data + self.seq_ids.itemsize * np.arange(
            capacity, dtype=np.uint64
        )
        self.output_flags = np.full(capacity, output_flags, dtype=np.int8)
        i32 = ctypes.POINTER(ctypes.c_int32)
        self.batch = llama_cpp.llama_batch(
            n_tokens=0,
            token=self.tokens.ctypes.data_as(i32),
            embd=None,
            pos=self.positions.ctypes.data_as(i32),
            n_seq_id=self.num_seq_ids.ctypes.data_as(i32),
            seq_id=self.seq_id_ptrs.ctypes.data_as(ctypes.POINTER(i32)),
            logits=self.output_flags.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
