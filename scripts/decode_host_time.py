"""Per decoded token: time inside llama_decode vs everything around it, ours vs llama.cpp's own
generate loop (llama-cpp-python), on the same GGUF. Batch 1, greedy, 128 tokens after 32.

    .venv/bin/python scripts/decode_host_time.py runs/quant/demo-code-int8/demo-code-int8.gguf

Where plain decode trails llama.cpp, this says whether the kernels or the host-side work
(scheduling, sampling, bookkeeping in Python) is the difference.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llama_cpp  # noqa: E402
import llama_cpp.llama_cpp as llama_cpp_lib  # noqa: E402

_decode = llama_cpp_lib.llama_decode
_inside_s = [0.0, 0]  # seconds inside llama_decode, calls


def _timed_decode(ctx, batch):
    started = time.perf_counter()
    status = _decode(ctx, batch)
    _inside_s[0] += time.perf_counter() - started
    _inside_s[1] += 1
    return status


# both our executor and llama-cpp-python look the function up on these modules at call time
llama_cpp_lib.llama_decode = llama_cpp.llama_decode = _timed_decode

from ultrafast.model_files import resolve_model  # noqa: E402
from ultrafast_harness.bench.decode import _llama_cpp, _ours  # noqa: E402
from ultrafast_harness.bench.server_process import DEMO_MODEL_DIR  # noqa: E402


def main() -> None:
    gguf = sys.argv[1] if len(sys.argv) > 1 else str(DEMO_MODEL_DIR / "demo-code-f16.gguf")
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    prompt = list(range(5, 37))
    runners = {
        "ours": _ours(resolve_model(DEMO_MODEL_DIR), gguf, prompt, 128, threads, "ggml"),
        "llama.cpp": _llama_cpp(gguf, prompt, 128, threads),
    }
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runners}
    for round_ in range(6):  # round 0 warms up; runners alternate
        for name, (run, _) in runners.items():
            _inside_s[:] = [0.0, 0]
            started = time.perf_counter()
            _, decode_s = run()
            total_s = time.perf_counter() - started
            calls = _inside_s[1]
            if round_:
                rows[name].append(
                    (
                        127 / decode_s,
                        1e6 * _inside_s[0] / calls,
                        1e6 * (total_s - _inside_s[0]) / calls,
                    )
                )
    for name, (_, close) in runners.items():
        close()
        tok_s, inside_us, outside_us = (
            statistics.median(r[k] for r in rows[name]) for k in range(3)
        )
        print(
            f"{name:10s} decode {tok_s:7.1f} tok/s; per llama_decode call: {inside_us:6.0f} us"
            f" inside, {outside_us:5.0f} us around it (median of 5 rounds)"
        )


if __name__ == "__main__":
    main()
