"""The wide passes' elementwise steps fused in C (kernels/fused_ops.c), where they build here,
agree with torch's and are faster; else torch's ops (wide_forward.py keeps both).

Why: between its GEMMs a wide pass layer ran ~20 torch ops (the norms with their bf16 copies,
RoPE as float copy + cat + neg + two muls + add, silu then mul): ~25% of a 512-token prefill
pass on the 2-core AMX Xeon, and in a 16-slot decode step hundreds of tiny ops a step, each a
Python dispatch. The fused calls do the same work in one pass over the rows each:
`norm_bf16` (RMS norm to bf16), `add_norm_bf16` (the residual add before it), `rope` (q|k
heads of the bf16 projection to RoPE'd float32; `rope_store` to the attention's bf16 inputs)
and `silu_mul` (silu(gate) * up to bf16). Numbers: the same float math, one bf16 rounding
where torch rounds silu's output before the product (so closer to float32).

`choice()` builds the library (native_build.py), checks each op against torch's on the
model's shapes, times both on 16 and 256 rows, and keeps the fused ops only where they win
both: a path by measurement, reported in one line.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ultrafast.executors.native_build import build_library

log = logging.getLogger(__name__)

BF16 = torch.bfloat16
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@dataclass
class FusedOps:
    lib: ctypes.CDLL
    kind: str  # "avx512" or "portable"


def build(extra_flags: tuple[str, ...] = ()) -> FusedOps | str:
    """The library built with native_build's flags + `extra_flags`, or why not (one line)."""
    lib = build_library("fused_ops", extra_flags)
    if isinstance(lib, str):
        return lib
    lib.rms_norm_bf16.argtypes = [_P, _I64, _P, _P, _I64, _I64, _F, _INT]
    lib.add_rms_norm_bf16.argtypes = [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _F, _INT]
    lib.silu_mul_bf16.argtypes = [_P, _I64, _P, _I64, _I64, _INT]
    lib.rope_f32.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT]
    lib.rope_store_bf16.argtypes = [_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64]
    lib.rope_store_bf16.argtypes += [_INT]
    fns = (lib.rms_norm_bf16, lib.add_rms_norm_bf16, lib.silu_mul_bf16, lib.rope_f32)
    for fn in (*fns, lib.rope_store_bf16):
        fn.restype = ctypes.c_int
    lib.kernel_kind.restype = ctypes.c_char_p
    return FusedOps(lib, lib.kernel_kind().decode())


def _rows_ok(t: torch.Tensor, dtype: torch.dtype, width: int) -> bool:
    """A 2-D tensor of `dtype` whose rows hold at least `width` contiguous elements."""
    return (
        t.dtype == dtype
        and t.dim() == 2
        and t.shape[1] >= width
        and t.stride(1) == 1
        and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1])
    )


def norm_bf16(ops: FusedOps, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16 RMS norm of float32 rows x [T, dim] by float32 weight [dim]."""
    rows, dim = x.shape
    if not _rows_ok(x, torch.float32, dim) or weight.dtype != torch.float32:
        raise ValueError("norm: float32 rows and weight")
    if weight.shape != (dim,) or not weight.is_contiguous():
        raise ValueError("norm: one contiguous weight per column")
    out = torch.empty(rows, dim, dtype=BF16)
    ops.lib.rms_norm_bf16(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, dim, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def add_norm_bf16(
    ops: FusedOps, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += y (float32 rows x, bf16 rows y [T, dim]: a residual stream and its branch's
    output), then `norm_bf16` of the sum: one pass where the add and the norm each read x
    (a mixed-dtype torch add alone was ~5% of a 512-token prefill pass, AMX Xeon)."""
    rows, dim = x.shape
    if not _rows_ok(x, torch.float32, dim) or not _rows_ok(y, BF16, dim) or y.shape != x.shape:
        raise ValueError("add_norm: float32 rows x and bf16 rows y of one shape")
    if weight.dtype != torch.float32 or weight.shape != (dim,) or not weight.is_contiguous():
        raise ValueError("add_norm: one contiguous float32 weight per column")
    out = torch.empty(rows, dim, dtype=BF16)
    ops.lib.add_rms_norm_bf16(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), weight.data_ptr(), out.data_ptr(),
        rows, dim, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(ops: FusedOps, h: torch.Tensor) -> torch.Tensor:
    """bf16 silu(gate) * up of bf16 rows h [T, 2n] (gate the first n columns)."""
    rows, width = h.shape
    if not _rows_ok(h, BF16, width) or width % 2:
        raise ValueError("silu_mul: bf16 rows of gate | up")
    out = torch.empty(rows, width // 2, dtype=BF16)
    ops.lib.silu_mul_bf16(
        h.data_ptr(), h.stride(0), out.data_ptr(), rows, width // 2, torch.get_num_threads()
    )
    return out


def rope(
    ops: FusedOps, h: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """float32 [T, heads, dim]: the first `heads` heads of bf16 rows h [T, >= heads * dim],
    RoPE'd (HF halves) by row t's cos / sin (float32 [T, dim], contiguous)."""
    rows = h.shape[0]
    if not _rows_ok(h, BF16, heads * dim) or dim % 2:
        raise ValueError("rope: bf16 rows of at least heads x dim, an even head size")
    for table in (cos, sin):
        if table.dtype != torch.float32 or table.shape != (rows, dim):
            raise ValueError("rope: float32 cos / sin, one row of head size per row")
        if not table.is_contiguous():
            raise ValueError("rope: contiguous cos / sin")
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    ops.lib.rope_f32(
        h.data_ptr(), h.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows, heads,
        dim, torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope_store(
    ops: FusedOps,
    h: torch.Tensor,
    heads: int,
    dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """A prefill chunk's projection rows h (bf16 [T, >= (heads + 2 kv_heads) * dim]: q, k, v
    heads) as attention reads them: returns the RoPE'd queries bf16 [T, heads, dim]; writes
    the RoPE'd keys to `keys` and the values to `values` (bf16 [kv_heads, T, dim] views of the
    KV mirror, one stride per head, each row's dims contiguous). Equal to `rope` rounded to
    bf16, with no float copy of q|k and no transposing copies into the mirror."""
    rows = h.shape[0]
    kv_heads = keys.shape[0]
    if not _rows_ok(h, BF16, (heads + 2 * kv_heads) * dim) or dim % 2:
        raise ValueError("rope_store: bf16 rows of q, k and v heads, an even head size")
    for table in (cos, sin):
        if table.dtype != torch.float32 or table.shape != (rows, dim) or not table.is_contiguous():
            raise ValueError("rope_store: contiguous float32 cos / sin, a row per row")
    for t in (keys, values):
        if t.dtype != BF16 or t.shape != (kv_heads, rows, dim) or t.stride()[1:] != (dim, 1):
            raise ValueError("rope_store: bf16 [kv_heads, T, dim] destinations, rows contiguous")
    if values.stride(0) != keys.stride(0):
        raise ValueError("rope_store: keys and values with one head stride")
    q = torch.empty(rows, heads, dim, dtype=BF16)
    ops.lib.rope_store_bf16(
        h.data_ptr(), h.stride(0), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
        keys.data_ptr(), values.data_ptr(), keys.stride(0), rows, heads, kv_heads, dim,
        torch.get_num_threads(),
    )  # fmt: skip
    return q


# ---- torch's versions (the reference and the fallback) ------------------------------------


def torch_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps).to(BF16)


def torch_add_norm_bf16(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return torch_norm_bf16(x.add_(y), weight, eps)


def torch_silu_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_rope(h, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x = h[:, : heads * dim].float().view(h.shape[0], heads, dim)
    cos, sin = cos[:, None], sin[:, None]
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---- the choice ----------------------------------------------------------------------------


@functools.cache
def choice(dim: int, inter: int, qk_heads: int, head_dim: int) -> tuple[FusedOps | None, str]:
    """The fused ops for a model of this shape (hidden size, MLP width, q + k heads, head
    size) if they build, agree with torch and win on 16 and 256 rows; and the status clause."""
    ops = build()
    if isinstance(ops, str):
        return None, f"elementwise: torch ({ops})"
    gen = torch.Generator().manual_seed(0)
    timings = {}
    for rows in (16, 256):
        x = torch.randn(rows, dim, generator=gen)
        weight = torch.rand(dim, generator=gen) + 0.5
        h = torch.randn(rows, max(2 * inter, qk_heads * head_dim), generator=gen).to(BF16)
        angles = torch.rand(rows, head_dim // 2, generator=gen) * 6.3
        cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
        pairs = _pairs(ops, x, weight, h[:, : 2 * inter], h, qk_heads, head_dim, cos, sin)
        for name, ours, theirs in pairs:
            try:
                agree = torch.allclose(ours().float(), theirs().float(), rtol=2e-2, atol=2e-2)
            except ValueError as exc:  # a shape the fused op refuses (an odd head size)
                return None, f"elementwise: torch (the fused {name}: {exc})"
            if not agree:
                return None, f"elementwise: torch (the {ops.kind} fused {name} disagrees)"
        timings[rows] = _time_both(pairs)
    figures = ", ".join(f"{a * 1e6:.0f} vs {b * 1e6:.0f} us" for a, b in timings.values())
    if any(a >= b for a, b in timings.values()):
        return None, f"elementwise: torch (the {ops.kind} fused ops: {figures} at 16 / 256 rows)"
    return ops, f"elementwise: {ops.kind} fused C ops ({figures} for torch at 16 / 256 rows)"


def _pairs(ops, x, weight, gate_up, h, qk_heads: int, head_dim: int, cos, sin) -> list:
    """(name, fused call, torch call) of each op on one set of inputs."""
    y = gate_up[:, : x.shape[1]]  # bf16 rows of x's width: the residual branch's output
    return [
        ("norm", lambda: norm_bf16(ops, x, weight, 1e-5), lambda: torch_norm_bf16(x, weight, 1e-5)),
        (  # on copies of x: each call adds to its rows
            "add_norm",
            lambda: add_norm_bf16(ops, x.clone(), y, weight, 1e-5),
            lambda: torch_add_norm_bf16(x.clone(), y, weight, 1e-5),
        ),
        ("silu_mul", lambda: silu_mul(ops, gate_up), lambda: torch_silu_mul(gate_up)),
        (
            "rope",
            lambda: rope(ops, h, qk_heads, head_dim, cos, sin),
            lambda: torch_rope(h, qk_heads, head_dim, cos, sin),
        ),
    ]


def _time_both(pairs: list) -> tuple[float, float]:
    """Best of 7 interleaved rounds of each set: the machine's drift hits both alike."""
    best = [float("inf"), float("inf")]
    for _ in range(7):
        for i in (1, 2):
            started = time.perf_counter()
            for pair in pairs:
                pair[i]()
            best[i - 1] = min(best[i - 1], time.perf_counter() - started)
    return best[0], best[1]
