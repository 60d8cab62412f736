"""Host-side time of one decode step: our engine with llama_decode replaced by a no-op.

    .venv/bin/python scripts/host_step_time.py [GGUF]

Batch 1, greedy, 512 steps after a real warm-up run; prints the best of 5 runs per step and
the split by phase (schedule, execute without the kernel, sampling, update, the step-cost
model). Caches are warm here: inside a real decode the same work runs after the kernel has
swept them, and costs about twice as much (scripts/decode_host_time.py measures that).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llama_cpp  # noqa: E402
import llama_cpp.llama_cpp as llama_cpp_lib  # noqa: E402

from ultrafast.model_files import resolve_model  # noqa: E402
from ultrafast_harness.bench.decode import _ours  # noqa: E402
from ultrafast_harness.bench.server_process import DEMO_MODEL_DIR  # noqa: E402

NUM_STEPS = 512


def main() -> None:
    gguf = sys.argv[1] if len(sys.argv) > 1 else str(DEMO_MODEL_DIR / "demo-code-f16.gguf")
    run, close = _ours(
        resolve_model(DEMO_MODEL_DIR), gguf, list(range(5, 37)), NUM_STEPS, 2, "ggml"
    )
    run()  # a real run: the graph, buffers and caches exist
    engine = run.engine
    llama_cpp_lib.llama_decode = llama_cpp.llama_decode = lambda ctx, batch: 0
    totals: dict[str, int] = {}

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            started = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0) + time.perf_counter_ns() - started

        setattr(owner, name, wrapper)

    best = None
    for timing in (False, True):  # untimed runs first: the wrappers add their own cost
        if timing:
            for owner, name in (
                (engine.scheduler, "schedule"),
                (engine.scheduler, "update"),
                (engine.executor, "execute"),
                (engine.costs, "observe"),
            ):
                timed(owner, name, name)
        for _ in range(5):
            totals.clear()
            started = time.perf_counter()
            run()
            elapsed = time.perf_counter() - started
            if not timing and (best is None or elapsed < best):
                best = elapsed
    close()
    print(
        f"host-only decode step: {1e6 * best / NUM_STEPS:.1f} us (best of 5 runs of "
        f"{NUM_STEPS} steps)"
    )
    print(
        "  last timed run, per step: "
        + ", ".join(f"{label} {v / NUM_STEPS / 1e3:.1f} us" for label, v in totals.items())
    )


if __name__ == "__main__":
    main()
