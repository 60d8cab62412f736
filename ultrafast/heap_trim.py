"""Freed heap pages back to the kernel: glibc's `malloc_trim(0)`, a no-op elsewhere.

glibc's malloc keeps what was freed inside its heaps (PyTorch's CPU tensors come from malloc;
glibc gives back only a heap's free top, not the free pages between live blocks), so a
process's memory stays at the peak of its largest transient. Callers trim after such a
transient (the engine after an idle stretch, engine/idle_trim.py; the wide path after its
weights' load, GEMM builds and timing, executors/wide_lazy.py).
"""

from __future__ import annotations

import ctypes


def glibc_trim() -> bool:
    """glibc's malloc_trim(0); True if it gave pages back (False: none, or not glibc)."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(malloc_trim(0))
