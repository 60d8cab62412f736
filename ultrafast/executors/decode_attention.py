"""The wide decode step's attention: a small C kernel (kernels/decode_attention.c) built for
this CPU at first use, or torch's SDPA where it cannot be built or is not faster here.

Why: in a 16-slot torch decode step, SDPA's flash kernel spent ~0.5 ms a layer on 48 tiny
problems (3 query heads against ~200 keys each) at ~7 GB/s; the C kernel reads each slot's
K/V rows once with a vectorized softmax: 2.5-4x faster on the 2-core AMX Xeon (16 slots,
30 / 200 / 1,100 positions: 22 / 95 / 665 us against 97 / 248 / 1,686 us a layer). Three
builds, by what the compiler targets: "avx512-bf16" (bf16 dot products on AVX512-BF16:
queries and probabilities rounded to bf16, as SDPA and the AMX prefill kernel round theirs;
a 16-slot step at 1,074 positions 23.5 against 28 ms for the float build, the keys read at
~17 against ~14 GB/s), "avx512" (float32, exact to float rounding) and "portable".

The build (native_build.py): `cc -O3 -march=native -fopenmp -shared` into the cache
directory, ~0.4 s once per machine, sharing torch's OpenMP pool. `load()` says why not where
there is no compiler or the build fails; `choose()` times kernel and SDPA on the model's shape and
keeps the faster (a portable build without AVX-512 may lose): a path by measurement.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from dataclasses import dataclass

import torch

from ultrafast.executors.native_build import build_library

log = logging.getLogger(__name__)

HEAD_DIMS = (64, 128)  # the kernel's head sizes; others keep SDPA
MAX_GROUP = 16  # query heads per KV head (MAX_GROUP in the C file)


@dataclass
class Kernel:
    lib: ctypes.CDLL
    kind: str  # "avx512-bf16", "avx512" or "portable"


@functools.cache
def load() -> Kernel | str:
    """The kernel built for this CPU (once per machine, cached), or why there is none."""
    return build()


def build(extra_flags: tuple[str, ...] = ()) -> Kernel | str:
    """The kernel built with native_build's flags + `extra_flags` (tests build the portable
    variants with -mno-avx512f or -mno-avx512bf16), or why there is none (one line)."""
    lib = build_library("decode_attention", extra_flags)
    if isinstance(lib, str):
        return lib
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
        ctypes.c_void_p,
    ]  # fmt: skip
    lib.kernel_kind.restype = ctypes.c_char_p
    return Kernel(lib, lib.kernel_kind().decode())


def unsupported(heads: int, kv_heads: int, head_dim: int) -> str | None:
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the kernel has {' and '.join(map(str, HEAD_DIMS))})"
    if heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return f"{heads} query heads over {kv_heads} KV heads"
    return None


@dataclass(frozen=True)
class Rows:
    """Which mirror row each query row reads and how many positions: int64 tensors for the
    kernel, their bounds as ints, checked once per step rather than per layer."""

    rows: torch.Tensor
    lens: torch.Tensor
    row_bounds: tuple[int, int]
    len_bounds: tuple[int, int]


def rows_of(rows: list[int], lens: list[int]) -> Rows:
    if len(rows) != len(lens) or not rows:
        raise ValueError("one row and one length per query row")
    return Rows(
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(lens, dtype=torch.int64),
        (min(rows), max(rows)),
        (min(lens), max(lens)),
    )


def attend(
    kernel: Kernel, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: Rows
) -> torch.Tensor:
    """float32 [B, heads, d]: each entry's queries (q: float32 [B, heads, d], rows of any
    stride, each row's heads contiguous) over positions [0, rows.lens[b]) of mirror row
    rows.rows[b] (keys, values: bf16 [rows, kv_heads, capacity, d] contiguous)."""
    batch, heads, dim = q.shape
    n_rows, kv_heads, capacity, _ = keys.shape
    # the checks that keep a wrong call from reading outside the tensors
    if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != dim:
        raise ValueError("queries must be float32 with each row's heads contiguous")
    for t in (keys, values):
        if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.shape != keys.shape:
            raise ValueError("keys and values must be contiguous bf16 of one shape")
    if len(rows.rows) != batch:
        raise ValueError("one mirror row per query row")
    if rows.row_bounds[0] < 0 or rows.row_bounds[1] >= n_rows:
        raise ValueError("a row outside the mirror")
    if rows.len_bounds[0] < 1 or rows.len_bounds[1] > capacity:
        raise ValueError("a length outside [1, capacity]")
    out = torch.empty(batch, heads, dim, dtype=torch.float32)
    status = kernel.lib.decode_attention(
        q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), rows.rows.data_ptr(),
        rows.lens.data_ptr(), batch, heads, kv_heads, dim, capacity, dim**-0.5,
        torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"no kernel for {heads} heads over {kv_heads}, head_dim {dim}")
    return out


def choose(heads: int, kv_heads: int, head_dim: int, sdpa_step) -> tuple[Kernel | None, str]:
    """The kernel where it builds, fits the model and beats `sdpa_step` (a callable timing
    the SDPA path's attention on the same shape, in seconds) on 16 slots at 256 positions;
    and the one-line reason."""
    kernel = load()
    if isinstance(kernel, str):
        return None, f"decode attention: torch SDPA ({kernel})"
    why = unsupported(heads, kv_heads, head_dim)
    if why is not None:
        return None, f"decode attention: torch SDPA ({why})"
    ours, theirs = _time_both(kernel, heads, kv_heads, head_dim, sdpa_step)
    figures = f"{ours * 1e6:.0f} vs {theirs * 1e6:.0f} us a layer at 16 x 256"
    if ours >= theirs:
        return None, f"decode attention: torch SDPA (the {kernel.kind} kernel: {figures})"
    return kernel, f"decode attention: {kernel.kind} C kernel ({figures} for SDPA)"


def _time_both(kernel: Kernel, heads: int, kv_heads: int, dim: int, sdpa_step):
    gen = torch.Generator().manual_seed(0)
    slots, length = 16, 256
    keys = torch.randn(slots, kv_heads, length, dim, generator=gen).to(torch.bfloat16)
    values = torch.randn(slots, kv_heads, length, dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(slots, heads, dim, generator=gen)
    rows = rows_of(list(range(slots)), [length] * slots)
    best = [float("inf"), float("inf")]
    for _ in range(7):  # interleaved, best of: the machine's drift hits both alike
        started = time.perf_counter()
        attend(kernel, q, keys, values, rows)
        best[0] = min(best[0], time.perf_counter() - started)
        best[1] = min(best[1], sdpa_step(q, keys, values, rows.lens))
    return best[0], best[1]
