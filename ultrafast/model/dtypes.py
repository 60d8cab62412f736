"""Torch dtypes by name: the model's dtype on a device, or the one a checkpoint asks for (shared
by the safetensors loader, the GGUF loader and the torch executor)."""

from __future__ import annotations

import torch

from ultrafast.model.config import ModelLoadError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def default_dtype(device: torch.device | str) -> torch.dtype:
    """float32 on the CPU (bf16 matmuls there are slow and lossy), bfloat16 on accelerators."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device | str, checkpoint_dtype: str = "float32"
) -> torch.dtype:
    """None -> default_dtype(device); "auto" -> the checkpoint's; else a name or torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return default_dtype(device)
    name = checkpoint_dtype if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]
