"""Small C kernels (executors/kernels/*.c) built for this CPU at first use.

`cc -O3 -march=native -fopenmp -shared` into the cache directory (kernels/, named by the
source, the compiler, the flags and the CPU's identity), once per machine, well under a second
for these files; the library's OpenMP is the libgomp torch loaded (same soname), so they share
one thread pool. Every failure is a one-line reason, never an exception: the caller keeps its
torch path and says why (decode_attention.py, fused_ops.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ultrafast.config import cache_dir
from ultrafast.cpu_info import cpu_identity

KERNELS = Path(__file__).parent / "kernels"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def build_library(name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | str:
    """kernels/`name`.c built with FLAGS + `extra_flags` (tests build portable variants with
    -mno-avx512f) and loaded, or why not (one line)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "no C compiler (cc or gcc) on PATH"
    source = KERNELS / f"{name}.c"
    flags = [*FLAGS, *extra_flags]
    key = hashlib.sha256(
        _sources_bytes(source)
        + " ".join([compiler, *flags, repr(sorted(cpu_identity().items()))]).encode()
    ).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"{name}-{key}.so"
    if not path.exists():
        error = _compile(compiler, flags, source, path)
        if error is not None:
            return error
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        return f"the built kernel does not load: {exc}"


AMX_REASONS = {  # the AMX kernels' ready() statuses (kernels/amx_tiles.h)
    -1: "this CPU's build has no AMX tiles",
    -3: "the OS does not grant this process the AMX tile state",
}


@dataclass
class Kernel:
    """A kernel library built for this CPU, and what it was built for ("amx", ...)."""

    lib: ctypes.CDLL
    kind: str


def ready_kernel(lib: ctypes.CDLL, ready: str, reasons: dict[int, str]) -> Kernel | str:
    """`lib` as a Kernel once its `ready()` returns 0, else the reason for its status."""
    lib.kernel_kind.restype = ctypes.c_char_p
    status = getattr(lib, ready)()
    if status != 0:
        return reasons.get(status, f"status {status}")
    return Kernel(lib, lib.kernel_kind().decode())


def _sources_bytes(source: Path) -> bytes:
    """The kernel's source and every header of the folder it may include: editing a shared
    header must rebuild the kernels that use it, not load a stale cached library."""
    headers = sorted(KERNELS.glob("*.h"))
    return b"".join(path.read_bytes() for path in [source, *headers])


def _compile(compiler: str, flags: list[str], source: Path, path: Path) -> str | None:
    """Compile into a temporary file, then rename: a concurrent build or a reader never sees
    a half-written library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, str(source)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            return f"the kernel did not compile: {lines[-1] if lines else done.returncode}"
        os.replace(tmp, path)
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the kernel did not compile: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
