"""Per-tensor type plans and applying them to a model.

A plan maps every 2-D weight of the model (HF names: `model.layers.0.mlp.up_proj.weight`,
`lm_head.weight`, `model.embed_tokens.weight`) to "f16" (kept in 16-bit), "int8" or "int4".
`lm_head.weight` and `model.embed_tokens.weight` are separate entries even when the checkpoint
ties them: the output projection and the lookup table can take different types.

Applying a plan swaps each quantized nn.Linear for an Int8Linear/Int4Linear. A quantized
embedding is stored as codes but looked up from its dequantized table (a lookup reads one row
per token, so packed storage would save memory, not time); that keeps nn.Embedding, whose
`.weight` the executors read for the dtype and device.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ultrafast.quant.linear import make_quant_linear, replace_module
from ultrafast.quant.tensors import INT4, INT8, QuantizedWeight, dequantize, quantize

KEEP = "f16"
TENSOR_TYPES = (KEEP, INT8, INT4)
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def weight_names(model: nn.Module) -> list[str]:
    """The quantizable 2-D weights in model order: embedding, every Linear, lm_head last."""
    names = [EMBED]
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            names.append(f"{name}.weight")
    return names + [LM_HEAD]


def uniform_plan(model: nn.Module, qtype: str) -> dict[str, str]:
    return {name: qtype for name in weight_names(model)}


def num_params(model: nn.Module, name: str) -> int:
    return get_weight(model, name).numel()


def _module_name(weight_name: str) -> str:
    return weight_name.rsplit(".", 1)[0]


def get_weight(model: nn.Module, name: str) -> torch.Tensor:
    """The weight tensor `name` ("model.layers.0.mlp.up_proj.weight") of `model`."""
    weight = model.get_submodule(_module_name(name)).weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} is not a tensor")
    return weight


def quantize_weights(
    model: nn.Module, plan: dict[str, str], group_size: int, zero_point: bool
) -> dict[str, QuantizedWeight]:
    """QuantizedWeight for every quantized entry of the plan (weights read from `model`)."""
    return {
        name: quantize(get_weight(model, name), qtype, group_size, zero_point)
        for name, qtype in plan.items()
        if qtype != KEEP
    }


def validate_plan(model: nn.Module, plan: dict[str, str]) -> None:
    known = set(weight_names(model))
    unknown = sorted(set(plan) - known)
    if unknown:
        raise ValueError(f"plan names tensors the model does not have: {unknown[:5]}")
    bad = sorted({t for t in plan.values() if t not in TENSOR_TYPES})
    if bad:
        raise ValueError(f"unknown tensor types {bad}; expected one of {TENSOR_TYPES}")


def apply_quantized(
    model: nn.Module, quantized: dict[str, QuantizedWeight], dtype: torch.dtype | None = None
) -> nn.Module:
    """Swap the quantized modules in (in place) and return the model."""
    for name, qw in quantized.items():
        module = model.get_submodule(_module_name(name))
        compute_dtype = dtype or get_weight(model, name).dtype
        if name == EMBED:
            table = dequantize(qw, compute_dtype)  # on the codes' device
            # a new Parameter: a tied lm_head keeps the original (unquantized) one
            module.weight = nn.Parameter(table, requires_grad=False)
            continue
        bias = getattr(module, "bias", None)
        replace_module(model, _module_name(name), make_quant_linear(qw, bias, compute_dtype))
    return model


def quantize_model(
    model: nn.Module, plan: dict[str, str], group_size: int = 32, zero_point: bool = False
) -> dict[str, QuantizedWeight]:
    """Quantize `model` in place by `plan`; returns the codes (for saving and GGUF export)."""
    validate_plan(model, plan)
    quantized = quantize_weights(model, plan, group_size, zero_point)
    apply_quantized(model, quantized)
    return quantized


@contextmanager
def fake_quantized(model: nn.Module, weights: dict[str, torch.Tensor]):
    """Temporarily replace weights by the given (dequantized) tensors; restores on exit.

    Used by the sensitivity search, where thousands of module swaps would be wasteful: the
    numbers are those of the reference dequantize path.
    """
    saved = []
    try:
        for name, tensor in weights.items():
            module = model.get_submodule(_module_name(name))
            saved.append((module, module.weight))
            module.weight = nn.Parameter(tensor, requires_grad=False)
        yield model
    finally:
        for module, weight in reversed(saved):
            module.weight = weight
