"""The wide prefill's attention on the CPU's matrix tiles: a C kernel (kernels/
prefill_attention.c) built for this CPU at first use where it has AMX, else torch's SDPA.

Why: after the GEMMs reached AMX's rate, torch's fused CPU attention was 36-40% of a
512-token pass after 488 positions (~200-400 GFLOP/s where a bf16 GEMM runs ~1,200 on the
same cores): its softmax walks each score block several times. The kernel keeps a 16 x 64
score block in registers between two sets of tile products (docs/ARCHITECTURE.md "Wide
passes"). Where the CPU has no AMX, the build has no kernel and SDPA stays; where it has, the
kernel is kept only if it agrees with SDPA and beats it on the model's shape (`choose`), and
the status line says which and why.
"""

from __future__ import annotations

import ctypes
import functools
import time

import torch
import torch.nn.functional as F

from ultrafast.executors.native_build import AMX_REASONS, Kernel, build_library, ready_kernel

BF16 = torch.bfloat16
HEAD_DIM = 64  # the kernel's head size (DIM in the C file); others keep SDPA
_REASONS = {**AMX_REASONS, -2: "a head size other than 64", -4: "out of memory"}


@functools.cache
def load() -> Kernel | str:
    """The kernel built for this CPU (once per machine, cached), or why there is none."""
    return build()


def build(extra_flags: tuple[str, ...] = ()) -> Kernel | str:
    """The kernel built with native_build's flags + `extra_flags` (tests build it without
    AMX: -mno-amx-tile), or why there is none (one line)."""
    lib = build_library("prefill_attention", extra_flags)
    if isinstance(lib, str):
        return lib
    lib.prefill_attention.restype = ctypes.c_int
    lib.prefill_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_float, ctypes.c_int, ctypes.c_void_p,
    ]  # fmt: skip
    return ready_kernel(lib, "prefill_attention_ready", _REASONS)


def attend(
    kernel: Kernel,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    out: torch.Tensor | None = None,
):
    """One sequence's T queries (bf16 [T, heads, d], each row's heads contiguous) over its
    keys and values (bf16 [kv_heads, total, d], each row's dims contiguous; the last T are
    the queries' own, causal): bf16 [T, heads * d], as `sdpa` computes it, written into
    `out` where given (contiguous: a pass's rows, with no copy of a result into them)."""
    t, heads, dim = q.shape
    kv_heads, total, _ = keys.shape
    # the checks that keep a wrong call from reading outside the tensors
    if q.dtype != BF16 or q.stride(2) != 1 or q.stride(1) != dim:
        raise ValueError("queries must be bf16 with each row's heads contiguous")
    for x in (keys, values):
        if x.dtype != BF16 or x.shape != keys.shape or x.stride(2) != 1:
            raise ValueError("keys and values must be bf16 of one shape, rows contiguous")
    if t < 1 or total < t or heads % kv_heads:
        raise ValueError(f"{t} queries over {total} keys, {heads} heads over {kv_heads}")
    if any(x.data_ptr() % 4 or any(s % 2 for s in x.stride()[:-1]) for x in (q, keys, values)):
        raise ValueError("the kernel reads dim pairs: tensors must be 4-byte aligned")
    if out is None:
        out = torch.empty(t, heads * dim, dtype=BF16)
    elif out.dtype != BF16 or out.shape != (t, heads * dim) or not out.is_contiguous():
        raise ValueError("the output must be bf16 [T, heads * d], contiguous")
    status = kernel.lib.prefill_attention(
        q.data_ptr(), q.stride(0),
        keys.data_ptr(), keys.stride(0), keys.stride(1),
        values.data_ptr(), values.stride(0), values.stride(1),
        total, t, heads, kv_heads, dim, dim**-0.5, torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(_REASONS.get(status, f"status {status}"))
    return out


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask=None) -> torch.Tensor:
    """torch's fused attention on the same call (`mask`: `causal_mask(T, total)`, built by
    the caller once per pass, or here)."""
    t, total = q.shape[0], keys.shape[1]
    queries, k, v = q.transpose(0, 1)[None], keys[None], values[None]
    if total == t:  # no earlier KV: the plain causal triangle
        out = F.scaled_dot_product_attention(queries, k, v, is_causal=True, enable_gqa=True)
    else:  # query i (position total - t + i) sees keys [0, total - t + i]
        mask = causal_mask(t, total, q.dtype) if mask is None else mask
        out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(t, -1)


def causal_mask(t: int, total: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    """The additive mask [t, total] in the queries' dtype of t queries at positions
    [total - t, total): 0 where query i sees key j <= total - t + i, else -inf. Additive
    rather than bool: SDPA turns a bool mask into this on every call (per layer), 13% of a
    512-query attention at 1,000 keys."""
    hidden = torch.arange(total)[None, :] > torch.arange(total - t, total)[:, None]
    return torch.zeros(t, total, dtype=dtype).masked_fill_(hidden, float("-inf"))


@functools.cache
def choose(heads: int, kv_heads: int, head_dim: int) -> tuple[Kernel | None, str]:
    """The kernel where it builds, fits the model, agrees with SDPA and beats it on a
    512-token chunk after 512 positions (a long prompt's second chunk: where attention
    weighs most, and a margin wide enough that a noisy start does not flip the choice);
    and the status clause."""
    kernel = load()
    if isinstance(kernel, str):
        return None, f"prefill attention: torch SDPA ({kernel})"
    if head_dim != HEAD_DIM or heads % kv_heads:
        why = f"head_dim {head_dim}, {heads} heads over {kv_heads}"
        return None, f"prefill attention: torch SDPA (the kernel has 64 only: {why})"
    gen = torch.Generator().manual_seed(0)
    t, total = 512, 1024
    q = torch.randn(t, heads, head_dim, generator=gen).to(BF16)
    keys = torch.randn(kv_heads, total, head_dim, generator=gen).to(BF16)
    values = torch.randn(kv_heads, total, head_dim, generator=gen).to(BF16)
    mask = causal_mask(t, total)
    ours, theirs = attend(kernel, q, keys, values), sdpa(q, keys, values, mask)
    if not torch.allclose(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2):
        return None, f"prefill attention: torch SDPA (the {kernel.kind} kernel disagrees)"
    best = _best_of_interleaved(
        lambda: attend(kernel, q, keys, values), lambda: sdpa(q, keys, values, mask)
    )
    figures = f"{best[0] * 1e6:.0f} vs {best[1] * 1e6:.0f} us a layer at 512 after 512"
    if best[0] >= best[1]:
        return None, f"prefill attention: torch SDPA (the {kernel.kind} kernel: {figures})"
    return kernel, f"prefill attention: {kernel.kind} C kernel ({figures} for SDPA)"


def _best_of_interleaved(*calls, rounds: int = 7) -> list[float]:
    """Each call's best time over `rounds` rounds, the calls interleaved in every round: the
    machine's drift (1.5-2x within minutes here) hits them alike."""
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, call in enumerate(calls):
            started = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - started)
    return best
