"""Which GGUF weight type an HF directory converts to when nobody names one ("auto").

The shipped rule: bf16 where the CPU has AVX-512 BF16 (llama.cpp's bf16 dot products then run
as native VDPBF16PS instructions), else f16. q8_0 (half the bytes, per-block scales) and f32
stay available by name. The rule reads /proc/cpuinfo only: no import of torch or llama.cpp, so
`ultrafast convert` and `serve` can say which type they use before loading anything.
"""

from __future__ import annotations

from pathlib import Path

OUT_TYPES = ("f32", "f16", "bf16", "q8_0")
AUTO = "auto"


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The feature flags of the first CPU listed (every core of a machine has the same)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()  # not Linux, or no /proc: the portable choice below
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86 / arm64 spelling
            return set(value.split())
    return set()


def fast_outtype(flags: set[str]) -> tuple[str, str]:
    """(GGUF type, why) of the rule for a CPU with these flags."""
    if "avx512_bf16" in flags:
        return "bf16", "auto: this CPU has AVX-512 BF16"
    return "f16", "auto: this CPU has no AVX-512 BF16"


def resolve_outtype(outtype: str, flags: set[str] | None = None) -> tuple[str, str]:
    """(GGUF type, why) for a requested type: a named type stays, "auto" applies the rule."""
    if outtype == AUTO:
        return fast_outtype(cpu_flags() if flags is None else flags)
    if outtype not in OUT_TYPES:
        choices = ", ".join((AUTO, *OUT_TYPES))
        raise ValueError(f"unsupported weight type {outtype!r}; choose from {choices}")
    return outtype, "as requested"
