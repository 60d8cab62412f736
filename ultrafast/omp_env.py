"""How long llama.cpp's idle kernel threads spin, set before any kernel library loads.

The llama-cpp-python wheel runs each forward pass on a libgomp (OpenMP) thread team. After a
pass libgomp's idle threads spin 300,000 times before they sleep: ~9.5 ms of a core on the
2-core EPYC after every pass (`python scripts/omp_idle_spin.py`). On a small machine that is a
core which the event loop, the tokenizer and a grammar compile wait for after each request.
At 10,000 spins the threads burn ~2 ms after a pass and still catch back-to-back decode
steps (the same step time). A choice the user made (GOMP_SPINCOUNT or OMP_WAIT_POLICY) wins;
peers a benchmark starts get libgomp's default back (`peer_env`), so they run as they ship.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SPIN_COUNT = "10000"
_SET_BY_US = False


def apply(environ=os.environ) -> bool:
    """Set GOMP_SPINCOUNT unless the user chose an OpenMP wait policy; True if set here.
    Must run before llama.cpp (or torch) loads libgomp, which reads it once at load."""
    global _SET_BY_US
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    _SET_BY_US = True
    return True


def peer_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` without the spin count this process set: for peer servers (llama.cpp's,
    vLLM's) that a benchmark compares against, which must run with their own defaults."""
    env = dict(environ)
    if _SET_BY_US and env.get("GOMP_SPINCOUNT") == SPIN_COUNT:
        del env["GOMP_SPINCOUNT"]
    return env
