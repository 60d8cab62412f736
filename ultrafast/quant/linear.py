"""Drop-in replacements for nn.Linear holding weight-only quantized weights, and the swap that
puts them into a model. The model code never checks a quant type: these are just modules.

Each module has a fast path on torch's weight-only kernels (CPU build of torch 2.13:
`aten._weight_int8pack_mm` for int8 per-channel, `aten._weight_int4pack_mm_for_cpu` with
`aten._convert_weight_to_int4pack_for_cpu` for int4 groups) and the reference twin
(`use_kernel = False`): dequantize with `tensors.dequantize` and run F.linear. A kernel that is
missing or refuses the shape/dtype at construction (a one-row probe) leaves the module on the
reference path, and `kernel` says which one runs. Measured limits of the kernels: int4 needs
out_features % 16 == 0 (it raises otherwise); int8 in bf16 crashes on K = 70, so int8 runs the
kernel only for in_features % 32 == 0.

On a CPU without AVX-512 torch's int8 kernel falls back to generic loops: cheap for one row,
but for a few hundred rows far slower than dequantize + F.linear. So the kernel only serves
batches of up to `max_kernel_rows` rows (decode steps); prefill chunks and perplexity windows
take the dequantize path. On this CPU the fast path for quantized weights is the ggml
executor on a GGUF (`gguf_export`); the torch modules are the reference and the GPU-ready path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ultrafast.quant.tensors import INT4, INT8, QuantizedWeight, dequantize


def _probe(forward, in_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    try:
        forward(torch.zeros(1, in_features, dtype=dtype, device=device))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class _QuantLinear(nn.Module):
    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = qw.in_features, qw.out_features
        self.qtype, self.group_size = qw.qtype, qw.group_size
        self.compute_dtype = dtype
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        )
        self.use_kernel = True
        self.max_kernel_rows = 1  # see the module docstring: larger batches dequantize
        self.kernel = "reference"

    def quantized_weight(self) -> QuantizedWeight:
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.quantized_weight(), self.compute_dtype)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _reference(self, x2: torch.Tensor) -> torch.Tensor:
        return F.linear(x2, self.dequantized_weight().to(x2.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        kernel = (
            self.use_kernel and self.kernel != "reference" and x2.shape[0] <= self.max_kernel_rows
        )
        y = self._kernel(x2) if kernel else self._reference(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"qtype={self.qtype}, group_size={self.group_size}, kernel={self.kernel}"
        )


class Int8Linear(_QuantLinear):
    """Symmetric per-output-channel int8 weights; activations stay in `dtype`."""

    qweight: torch.Tensor  # buffers, declared for the type checker
    scales: torch.Tensor

    def __init__(
        self,
        qw: QuantizedWeight,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__(qw, bias, dtype)
        self.register_buffer("qweight", qw.codes.contiguous())
        self.register_buffer("scales", qw.scales.to(dtype))
        # the bf16 kernel segfaults on odd row lengths (K = 70), a probe cannot catch that
        if (
            self.in_features % 32 == 0
            and hasattr(torch.ops.aten, "_weight_int8pack_mm")
            and _probe(self._kernel, self.in_features, dtype, self.qweight.device)
        ):
            self.kernel = "aten._weight_int8pack_mm"

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(INT8, self.qweight, self.scales.float(), None, self.in_features)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)


class Int4Linear(_QuantLinear):
    """Group-wise int4 weights (q4_0 or q4_1 semantics, see tensors.py)."""

    codes: torch.Tensor  # buffers, declared for the type checker
    scales: torch.Tensor
    mins: torch.Tensor | None
    kernel_weight: torch.Tensor
    kernel_scales_zeros: torch.Tensor

    def __init__(
        self,
        qw: QuantizedWeight,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__(qw, bias, dtype)
        self.padded_in_features = qw.codes.shape[1]
        self.register_buffer("codes", qw.codes.contiguous())  # the reference path's input
        self.register_buffer("scales", qw.scales.contiguous())
        self.register_buffer("mins", None if qw.mins is None else qw.mins.contiguous())
        try:
            self._pack_for_kernel(qw, dtype)
        except (RuntimeError, NotImplementedError, AttributeError):
            return
        if _probe(self._kernel, self.in_features, dtype, self.codes.device):
            self.kernel = "aten._weight_int4pack_mm_for_cpu"

    def _pack_for_kernel(self, qw: QuantizedWeight, dtype: torch.dtype) -> None:
        # the kernel computes w = (q - 8) * scale + zero per group, with scale/zero laid out
        # [num_groups, N, 2]; q4_0 has zero 0, q4_1's "q * d + min" is zero = min + 8 * d
        d = qw.scales.float()
        zero = torch.zeros_like(d) if qw.mins is None else qw.mins.float() + 8.0 * d
        self.register_buffer(
            "kernel_scales_zeros", torch.stack([d.t(), zero.t()], dim=-1).contiguous().to(dtype)
        )
        self.register_buffer(
            "kernel_weight",
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.codes.to(torch.int32), 1),
        )

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(
            INT4, self.codes, self.scales, self.mins, self.in_features, self.group_size
        )

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        if self.padded_in_features != self.in_features:  # padding codes multiply zeros
            x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.contiguous(), self.kernel_weight, self.group_size, self.kernel_scales_zeros
        )


def make_quant_linear(
    qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype
) -> _QuantLinear:
    return (Int8Linear if qw.qtype == INT8 else Int4Linear)(qw, bias, dtype)


def set_use_kernel(model: nn.Module, use_kernel: bool, max_kernel_rows: int | None = None) -> None:
    """Switch every quantized module between its kernel and the reference dequantize path."""
    for module in model.modules():
        if isinstance(module, _QuantLinear):
            module.use_kernel = use_kernel
            if max_kernel_rows is not None:
                module.max_kernel_rows = max_kernel_rows


def quantized_modules(model: nn.Module) -> dict[str, _QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, _QuantLinear)}


def replace_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)
