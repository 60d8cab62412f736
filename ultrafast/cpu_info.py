"""What CPU this is, in the words a benchmark row and a measurement cache need: its model
name and its matrix features (AMX, AVX-512 BF16, VNNI), read from /proc/cpuinfo only (no
import of torch or llama.cpp)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ultrafast.weight_format import cpu_flags

MATRIX_FEATURES = {  # feature -> any of these /proc/cpuinfo flags
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
    "avx512_bf16": ("avx512_bf16",),
    "vnni": ("avx512_vnni", "avx_vnni"),
    "avx512": ("avx512f",),
    "avx2": ("avx2",),
}


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The first CPU's model name ("Intel(R) Xeon(R) Processor"), or the machine type."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return os.uname().machine
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("model name", "Model", "cpu model"):
            return value.strip()
    return os.uname().machine


def matrix_features(flags: set[str] | None = None) -> dict[str, bool]:
    flags = cpu_flags() if flags is None else flags
    return {name: any(f in flags for f in wanted) for name, wanted in MATRIX_FEATURES.items()}


def describe_cpu(cpuinfo: str | Path = "/proc/cpuinfo") -> dict:
    """Model, usable cores and matrix features, for every benchmark row."""
    features = matrix_features(cpu_flags(cpuinfo))
    return {
        "cpu_model": cpu_model(cpuinfo),
        "cores": len(os.sched_getaffinity(0)),
        **{f"cpu_{k}": v for k, v in features.items()},
    }


def cpu_identity() -> dict:
    """What a measured cost depends on about the CPU: its model, every feature flag (hashed)
    and the cores this process may use."""
    flags = " ".join(sorted(cpu_flags()))
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "cores": sorted(os.sched_getaffinity(0)),
    }
