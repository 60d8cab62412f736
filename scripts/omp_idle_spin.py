"""What libgomp's idle spinning costs: CPU burned by llama.cpp's kernel threads in the 20 ms
after a forward pass, and the time of back-to-back one-token passes, at several
GOMP_SPINCOUNT values (libgomp reads it once at load, so each runs in its own process).

The llama-cpp-python wheel is built with OpenMP: after a pass its idle thread spins ~9.5 ms
(a core the event loop and a grammar compile then wait for). Lowering GOMP_SPINCOUNT frees
that core sooner, but ggml's barrier between ops is an OpenMP barrier too, so under contention
a waiting thread sleeps mid-pass: at 10,000 SmolLM2's served batch-1 decode lost ~4%, which is
why the server keeps libgomp's default (BENCHMARKS.md, sixth session).

    python scripts/omp_idle_spin.py [GGUF] [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

SETTINGS = ("libgomp default", "10000", "1000")


def measure(gguf: str, rounds: int) -> None:
    import llama_cpp

    threads = len(os.sched_getaffinity(0))
    m = llama_cpp.Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    burned, steps = [], []
    for _ in range(rounds):
        m.reset()
        m.eval([1, 2, 3])
        start = time.perf_counter()
        for t in range(16):  # back to back, as a lone stream decodes
            m.eval([5 + t])
        steps.append((time.perf_counter() - start) / 16)
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(0.02)  # idle after the pass: only spinning threads use CPU
        after = resource.getrusage(resource.RUSAGE_SELF)
        burned.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    print(
        f"{statistics.median(burned) * 1e3:.2f} ms CPU in the 20 ms after a pass, "
        f"{statistics.median(steps) * 1e3:.3f} ms a back-to-back one-token pass"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", default="models/demo-code/demo-code-f16.gguf")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure(args.gguf, args.rounds)
        return
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    for setting in SETTINGS:
        env = dict(base) if setting == SETTINGS[0] else {**base, "GOMP_SPINCOUNT": setting}
        out = subprocess.run(
            [sys.executable, __file__, args.gguf, "--rounds", str(args.rounds), "--child"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        print(f"GOMP_SPINCOUNT={setting}: {out.stdout.strip()}")


if __name__ == "__main__":
    main()
