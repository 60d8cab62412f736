"""The hybrid policy: measure how much each weight hurts when it alone is 4-bit, keep the most
sensitive ones in 16-bit and quantize the rest to int4.

Sensitivity of a tensor = increase of the mean next-token loss (nats/token) on calibration text
when only that tensor is replaced by its int4 dequantization (the reference path), everything
else full precision. The plan then starts from "everything int4" and keeps tensors in 16-bit in
order of decreasing sensitivity until the calibration perplexity is close enough to full
precision, or the 16-bit budget (a fraction of all weight parameters) would be exceeded:

    target ratio = min(max_ppl_ratio, 1 + (1 - recover) * (int4_ratio - 1))

i.e. recover at least `recover` of plain int4's perplexity excess (the model-relative goal; a
model that int4 barely hurts keeps little in 16-bit), and never exceed `max_ppl_ratio`. Each
step is recorded, so the output says why every tensor got its type. `keep_type` "int8" keeps
the sensitive tensors in 8-bit instead (GGUF q8_0: cheaper to read than f16 on a CPU).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ultrafast.quant.evaluate import torch_nll
from ultrafast.quant.plan import (
    INT4,
    INT8,
    KEEP,
    fake_quantized,
    get_weight,
    num_params,
    weight_names,
)
from ultrafast.quant.tensors import dequantize, quantize


@dataclass
class HybridReport:
    fp_loss: float  # mean nats/token of the full-precision model on calibration text
    int4_loss: float  # everything int4
    hybrid_loss: float  # the chosen plan
    target_ppl_ratio: float
    keep_budget_params: int
    sensitivity: dict[str, float]  # tensor -> loss increase when only it is int4
    kept: list[str] = field(default_factory=list)  # in the order they were kept
    steps: list[dict] = field(default_factory=list)  # {"kept": name, "ppl_ratio": ...}

    @property
    def hybrid_ppl_ratio(self) -> float:
        return math.exp(self.hybrid_loss - self.fp_loss)

    def to_json(self) -> dict:
        out = asdict(self)
        out["int4_ppl_ratio"] = math.exp(self.int4_loss - self.fp_loss)
        out["hybrid_ppl_ratio"] = self.hybrid_ppl_ratio
        return out


def _mean_loss(model: nn.Module, token_windows: list[list[int]]) -> float:
    nll, count = torch_nll(model, token_windows)
    return nll / count


def int4_weights(
    model: nn.Module, names: list[str], group_size: int, zero_point: bool
) -> dict[str, torch.Tensor]:
    """The reference dequantization of each named weight's int4 version."""
    out = {}
    for name in names:
        weight = get_weight(model, name)
        out[name] = dequantize(quantize(weight, INT4, group_size, zero_point), weight.dtype)
    return out


def measure_sensitivity(
    model: nn.Module, token_windows: list[list[int]], fake: dict[str, torch.Tensor], fp_loss: float
) -> dict[str, float]:
    sensitivity = {}
    for name, tensor in fake.items():
        with fake_quantized(model, {name: tensor}):
            sensitivity[name] = _mean_loss(model, token_windows) - fp_loss
    return sensitivity


def hybrid_plan(
    model: nn.Module,
    token_windows: list[list[int]],
    group_size: int = 32,
    zero_point: bool = False,
    recover: float = 0.5,
    max_ppl_ratio: float = 1.03,
    max_keep_fraction: float = 0.15,
    keep_type: str = KEEP,
) -> tuple[dict[str, str], HybridReport]:
    """(per-tensor type plan, report); `model` is full precision and left unchanged."""
    if not 0.0 <= recover <= 1.0 or not 0.0 <= max_keep_fraction <= 1.0:
        raise ValueError("recover and max_keep_fraction must lie in [0, 1]")
    names = weight_names(model)
    fake = int4_weights(model, names, group_size, zero_point)
    fp_loss = _mean_loss(model, token_windows)
    sensitivity = measure_sensitivity(model, token_windows, fake, fp_loss)
    with fake_quantized(model, fake):
        int4_loss = _mean_loss(model, token_windows)
    int4_ratio = math.exp(int4_loss - fp_loss)
    target = min(max_ppl_ratio, 1.0 + (1.0 - recover) * (int4_ratio - 1.0))
    budget = int(max_keep_fraction * sum(num_params(model, n) for n in names))
    report = HybridReport(fp_loss, int4_loss, int4_loss, target, budget, sensitivity)
    plan = {name: INT4 for name in names}
    used = 0
    fake8: dict[str, torch.Tensor] = {}
    for name in sorted(names, key=lambda n: sensitivity[n], reverse=True):
        if report.hybrid_ppl_ratio <= target:
            break
        size = num_params(model, name)
        if used + size > budget:
            continue  # too big for what is left of the budget; a smaller one may still fit
        plan[name] = keep_type
        used += size
        if keep_type == INT8:  # evaluate what will run: the int8 dequantization
            weight = get_weight(model, name)
            fake8[name] = dequantize(quantize(weight, INT8), weight.dtype)
        with fake_quantized(model, {**fake8, **{n: fake[n] for n, t in plan.items() if t == INT4}}):
            report.hybrid_loss = _mean_loss(model, token_windows)
        report.kept.append(name)
        report.steps.append(
            {
                "kept": name,
                "params": size,
                "sensitivity": sensitivity[name],
                "ppl_ratio": report.hybrid_ppl_ratio,
            }
        )
    return plan, report
