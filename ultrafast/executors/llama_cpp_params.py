"""How every llama.cpp model here is loaded: our ggml executor, the llama.cpp peer, the tests.

llama.cpp's AMX weight buffers (an "extra buffer type" that repacks q8_0 / q4_0 weights for
Intel AMX tiles) segfault in the first decode on this project's AMX Xeons (llama-cpp-python
0.3.36 built with -march=native; f16 models are unaffected). Where the CPU has AMX, models load
without extra buffer types, so our executor and the llama.cpp peer both run llama.cpp's plain
AVX-512 kernels and stay comparable. ULTRAFAST_GGML_EXTRA_BUFFERS=1 (or 0) forces the choice.
"""

from __future__ import annotations

import contextlib
import os
from functools import lru_cache

import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_lib


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
