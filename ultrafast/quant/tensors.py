"""Weight-only quantization of one 2-D weight [out_features, in_features], and its reference
dequantization (the slow twin every kernel is checked against).

Two formats:
- int8: symmetric, one float32 scale per output channel (row): w ~= q * scale, q in [-127, 127].
- int4: one scale per group of `group_size` consecutive inputs of a row. Symmetric (default)
  follows ggml's q4_0 exactly: d = (the signed value of largest magnitude) / -8, codes
  q = trunc(x / d + 8.5) in [0, 15], w ~= (q - 8) * d. With a zero point it follows q4_1:
  d = (max - min) / 15, w ~= q * d + min. Scales (and mins) are rounded to float16, which is
  what GGUF stores, so a GGUF block written from these codes dequantizes to the very same
  numbers (`gguf_export` relies on it; a test checks it with gguf's own dequantizer).

Rows whose length is not a multiple of the group size are zero-padded to the next multiple;
padding codes dequantize to exactly 0 (symmetric) and are cut off by `dequantize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8, INT4 = "int8", "int4"


@dataclass
class QuantizedWeight:
    qtype: str  # INT8 or INT4
    codes: torch.Tensor  # int8 [N, K] (int8), or uint8 [N, K_padded] values 0..15 (int4)
    scales: torch.Tensor  # float32 [N] (int8), float16 [N, num_groups] (int4)
    mins: torch.Tensor | None  # float16 [N, num_groups]: int4 with zero point; else None
    in_features: int  # K before padding
    group_size: int = 0  # int4 only

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1] if self.qtype == INT4 else 1


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8 (round to nearest)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    codes = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(INT8, codes, scales, None, w.shape[1])


def _pad_to_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    pad = (-w.shape[1]) % group_size
    return torch.nn.functional.pad(w, (0, pad)) if pad else w


def quantize_int4(
    weight: torch.Tensor, group_size: int = 32, zero_point: bool = False
) -> QuantizedWeight:
    """Group-wise int4; q4_0 semantics when symmetric, q4_1 with a zero point (see module doc)."""
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even number >= 2, got {group_size}")
    num_rows, num_cols = weight.shape
    w = _pad_to_groups(weight.detach().float(), group_size)
    groups = w.view(num_rows, -1, group_size)
    if zero_point:
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        d = (high - low) / 15.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.trunc((groups - low[..., None]) * inv[..., None] + 0.5).clamp_(0, 15)
        mins = low.to(torch.float16)
    else:
        # the element of largest magnitude, with its sign, maps to code 0 exactly (-8 * d)
        idx = groups.abs().argmax(dim=-1, keepdim=True)
        d = groups.gather(-1, idx).squeeze(-1) / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.trunc(groups * inv[..., None] + 8.5).clamp_(0, 15)
        mins = None
    codes = codes.to(torch.uint8).view(num_rows, -1)
    return QuantizedWeight(INT4, codes, d.to(torch.float16), mins, num_cols, group_size)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: the float weight [N, K] these codes stand for, computed in float32."""
    if qw.qtype == INT8:
        return (qw.codes.float() * qw.scales.float()[:, None]).to(dtype)
    groups = qw.codes.float().view(qw.out_features, qw.num_groups, qw.group_size)
    d = qw.scales.float()[..., None]
    if qw.mins is None:
        w = (groups - 8.0) * d
    else:
        w = groups * d + qw.mins.float()[..., None]
    return w.view(qw.out_features, -1)[:, : qw.in_features].to(dtype)


def quantize(
    weight: torch.Tensor, qtype: str, group_size: int = 32, zero_point: bool = False
) -> QuantizedWeight:
    if qtype == INT8:
        return quantize_int8(weight)
    if qtype == INT4:
        return quantize_int4(weight, group_size, zero_point)
    raise ValueError(f"unknown quantized type {qtype!r}; expected {INT8!r} or {INT4!r}")


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes 0..15 (K even) -> uint8 [N, K / 2]: element 2j low, 2j+1 high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out
