"""A few rows times a oneDNN-packed bf16 weight on the CPU's AMX tiles: a C kernel
(kernels/tile_gemm.c) that reads the weight where oneDNN packed it, so it holds no copy.

Why: a wide decode step multiplies 16 rows by every weight of the model, a stream of the
weights (212 MB a step for SmolLM2), and oneDNN's own kernel for that shape streamed them at
~14 GB/s from the L3 on the 2-core AMX Xeon. packed_linear.py offers this kernel as one more
per-row-count choice (TILES), kept only at the row counts where it measured faster and only
for weights whose packed layout `layout_of` recognized.

Where the CPU has no AMX the build has no kernel (`load` says why, one line) and oneDNN's
products stay.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ultrafast.executors.native_build import AMX_REASONS, Kernel, build_library, ready_kernel

BF16 = torch.bfloat16
MAX_ROWS = 16  # rows of x one call takes (one A tile)
KB = 32  # the weight's input block


@functools.cache
def load() -> Kernel | str:
    """The kernel built for this CPU (once per machine, cached), or why there is none."""
    return build()


def build(extra_flags: tuple[str, ...] = ()) -> Kernel | str:
    lib = build_library("tile_gemm", extra_flags)
    if isinstance(lib, str):
        return lib
    lib.tile_gemm_bf16.restype = ctypes.c_int
    lib.tile_gemm_bf16.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    return ready_kernel(lib, "tile_gemm_ready", AMX_REASONS)


def layout_of(packed: torch.Tensor, plain: torch.Tensor) -> int | None:
    """The output block (32 or 64) of oneDNN's `AB16b{nb}a2b` layout that `packed` holds
    `plain` [n, k] bf16 in, or None when it is neither (another layout, padding, a plain
    tensor): read back from the packed bytes, every element compared."""
    if not packed.is_mkldnn or plain.dtype != BF16 or plain.dim() != 2:
        return None
    n, k = plain.shape
    try:  # ops of torch's mkldnn build: absent from another build, which keeps oneDNN
        if torch.ops.mkldnn._nbytes(packed) != n * k * 2 or k % KB:
            return None
        raw = _packed_view(packed, n * k)
    except (AttributeError, RuntimeError):
        return None
    for nb in (32, 64):
        if n % nb == 0 and torch.equal(raw, blocked(plain, nb)):
            return nb
    return None


def blocked(plain: torch.Tensor, nb: int) -> torch.Tensor:
    """`plain` [n, k] as int16 in `AB16b{nb}a2b` order, flat (the layout's definition)."""
    n, k = plain.shape
    bits = plain.contiguous().view(torch.int16)
    return bits.reshape(n // nb, nb, k // KB, KB // 2, 2).permute(0, 2, 3, 1, 4).reshape(-1)


def _packed_view(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The packed tensor's bytes as int16 (a view: valid while `packed` lives)."""
    address = torch.ops.mkldnn.data_ptr(packed)
    buffer = (ctypes.c_int16 * numel).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.int16, count=numel)


def product(kernel: Kernel, x: torch.Tensor, packed: torch.Tensor, nb: int) -> torch.Tensor:
    """bf16 x [..., k] (at most MAX_ROWS rows) @ W.T for W packed in `AB16b{nb}a2b`:
    bf16 [..., n]."""
    n, k = packed.shape
    flat = x.reshape(-1, k)
    if flat.dtype != BF16 or flat.stride(-1) != 1:
        flat = flat.to(BF16).contiguous()
    rows = flat.shape[0]
    out = torch.empty(rows, n, dtype=BF16)
    status = kernel.lib.tile_gemm_bf16(
        flat.data_ptr(), flat.stride(0), torch.ops.mkldnn.data_ptr(packed), n, k, nb,
        out.data_ptr(), n, rows, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"tile_gemm: {rows} rows x [{n}, {k}] in blocks of {nb}: status {status}")
    return out.view(*x.shape[:-1], n)
