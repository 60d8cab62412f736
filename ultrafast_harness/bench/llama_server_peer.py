"""`python -m ultrafast_harness.bench.llama_server_peer ARGS...`: llama-cpp-python's OpenAI server
(`python -m llama_cpp.server ARGS...`), its model loaded the way every llama.cpp model here is
(executors/llama_cpp_params.py): without llama.cpp's AMX extra buffer types where they crash.
On an AMX Xeon the plain server dies with SIGILL at its first decode of a quantized GGUF (the
default Q4_1 model); ours runs the same plain AVX-512 kernels, so the two stay comparable."""

from __future__ import annotations

import runpy

import llama_cpp.llama_cpp as llama_cpp_lib

from ultrafast.executors.llama_cpp_params import model_params

if __name__ == "__main__":
    llama_cpp_lib.llama_model_default_params = model_params  # what Llama.__init__ calls
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
