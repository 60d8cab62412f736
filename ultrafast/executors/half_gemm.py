"""A few float32 rows times a float16 copy of a weight: a C kernel (kernels/half_gemm.c) for
the CPUs whose wide passes multiply in float32 (no bf16 instructions).

Why: there a wide decode step streams every float32 weight (424 MB a step for SmolLM2), and
oneDNN's float32 product of 16 rows ran the step's GEMMs in 55 ms on the 2-core AVX2 EPYC;
the same products from an exact float16 copy with F16C took 28 ms (1 row: 29 -> 11 ms, 32
rows: 83 -> 55; the same sums up to their order). packed_linear.py offers it as one more
per-row-count choice (HALF), timed over every layer as a step streams them, and keeps the
copy only where some row count chose it.

A matrix has a copy only where every value round-trips through float16 (a bf16 GGUF's do
while they stay within float16's range) and its output count is a multiple of BLOCK; a CPU
without F16C/FMA has no kernel (`load` says why, one line).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ultrafast.executors.native_build import Kernel, build_library, ready_kernel

BLOCK = 16  # outputs per packed block (NB in the C file)
REASONS = {-1: "this CPU's build has no F16C / FMA (AVX2) instructions"}


@functools.cache
def load() -> Kernel | str:
    """The kernel built for this CPU (once per machine, cached), or why there is none."""
    return build()


def build(extra_flags: tuple[str, ...] = ()) -> Kernel | str:
    lib = build_library("half_gemm", extra_flags)
    if isinstance(lib, str):
        return lib
    lib.half_gemm.restype = None
    lib.half_gemm.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
    ]  # fmt: skip
    return ready_kernel(lib, "half_gemm_ready", REASONS)


def pack(matrix: torch.Tensor) -> torch.Tensor | None:
    """`matrix` [n, k] as float16 blocks [n / BLOCK, k, BLOCK], or None where a value does not
    round-trip through float16 exactly or n is not a multiple of BLOCK."""
    n, k = matrix.shape
    if n % BLOCK:
        return None
    half = matrix.to(torch.float16)
    if not torch.equal(half.to(matrix.dtype), matrix):
        return None
    return half.view(n // BLOCK, BLOCK, k).transpose(1, 2).contiguous()


def product(
    kernel: Kernel, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., k] @ W.T (+ bias) for W packed by `pack`, float32 out (x widened if needed)."""
    blocks, k, _ = packed.shape
    n = blocks * BLOCK
    flat = x.reshape(-1, k)
    if flat.dtype != torch.float32 or flat.stride(-1) != 1:
        flat = flat.to(torch.float32).contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.to(torch.float32).contiguous()
    out = torch.empty(flat.shape[0], n, dtype=torch.float32)
    kernel.lib.half_gemm(
        flat.data_ptr(),
        flat.shape[0],
        flat.stride(0),
        k,
        packed.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], n)
