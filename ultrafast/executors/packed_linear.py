"""bf16 weights packed once into oneDNN's own blocked layout for the wide passes' GEMMs.

Why: `F.linear` on bf16 CPU tensors calls oneDNN, which reorders the weight into its blocked
(AMX / AVX-512) layout on every call. At a wide decode step's 16 rows the reorder costs about as
much as the product itself (2-core AMX Xeon, one thread, best of 40: gate/up [3072 x 576] 420 ->
267 us, the lm_head [49152 x 576] 8.7 -> 6.9 ms; 1,770 vs 2,064 us at 256 rows). mkldnn's
`_reorder_linear_weight` does the reorder once, at load (the op PyTorch's inductor uses when it
freezes weights); the packed tensor is the same size and its products are the same numbers.

Where the op is missing or its products differ from `F.linear`'s (a build without mkldnn, a
oneDNN without bf16 kernels on this CPU), weights stay plain tensors and `linear` is `F.linear`:
`pack_support()` says which, once, for the wide path's start-up line.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ROWS_HINT = 16  # oneDNN picks its blocking for this many rows; every row count works


@functools.cache
def pack_support() -> str | None:
    """None when packed weights work here (checked against F.linear), else why not."""
    mkldnn = torch.backends.mkldnn
    if not mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bf16 kernels for this CPU"
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    for rows in (1, 16, 40):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        try:
            got = _packed_linear(x, _reorder(weight), bias)
        except RuntimeError as exc:  # an op this build lacks
            return f"packing failed ({exc})"
        want = F.linear(x, weight, bias)
        if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
            return "packed products differ from F.linear's"
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's layout when that works here, else `weight` itself."""
    if weight.dtype != torch.bfloat16 or pack_support() is not None:
        return weight
    return _reorder(weight.contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x @ weight.T + bias for a packed or a plain weight."""
    if weight.is_mkldnn:
        return _packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
