"""What a verify pass costs by width, and the speed-up speculation could reach with it.

    .venv/bin/python scripts/verify_pass_width.py GGUF [GGUF ...] [--threads N]

For each model: llama.cpp's time for one pass of n tokens (one sequence after 64 cached tokens,
logits for every row, as a verify step asks) for n = 1..16, as a multiple of a 1-token pass;
then, per per-token acceptance rate a, the best decode speed-up over plain decoding any draft
length could give: max over n of E[tokens per pass] / (pass(n) / pass(1)), where a pass of
n = k + 1 tokens yields (1 - a^n) / (1 - a) tokens on average. Drafts are free here (n-gram
lookup is ~0.03 ms), so this is a ceiling for speculation on that machine and model.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrafast.executors.llama_cpp_params import model_params  # noqa: E402

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
ACCEPTANCE = (0.8, 0.9, 0.95, 1.0)
CACHED = 64


def pass_times(path: str, threads: int, reps: int = 40) -> dict[int, float]:
    model = llama_cpp.llama_model_load_from_file(path.encode(), model_params())
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx, ctx_params.n_batch, ctx_params.n_ubatch = 1024, 512, 512
    ctx_params.n_threads = ctx_params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, ctx_params)
    memory = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(max(WIDTHS + (CACHED,)), 0, 1)

    def decode(start: int, width: int) -> float:
        batch.n_tokens = width
        for i in range(width):
            batch.token[i], batch.pos[i] = 100 + (start + i) % 50, start + i
            batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = 1, 0, 1
        started = time.perf_counter()
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - started

    try:
        decode(0, CACHED)
        out = {}
        for width in WIDTHS:
            times = []
            for _ in range(reps):
                times.append(decode(CACHED, width))
                llama_cpp.llama_memory_seq_rm(memory, 0, CACHED, -1)  # drop the "drafts"
            out[width] = statistics.median(times[2:])
        return out
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def ceiling(relative: dict[int, float], acceptance: float) -> float:
    def tokens(n: int) -> float:
        return float(n) if acceptance >= 1 else (1 - acceptance**n) / (1 - acceptance)

    return max(tokens(n) / cost for n, cost in relative.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    llama_cpp.llama_backend_init()
    print(
        "| model | "
        + " | ".join(f"{n} tok" for n in WIDTHS)
        + " | "
        + " | ".join(f"ceiling a={a}" for a in ACCEPTANCE)
        + " |"
    )
    print("|---" * (1 + len(WIDTHS) + len(ACCEPTANCE)) + "|")
    for path in args.gguf:
        times = pass_times(path, args.threads)
        relative = {n: t / times[1] for n, t in times.items()}
        cells = [f"{1e3 * times[1]:.2f} ms"] + [f"{relative[n]:.2f}x" for n in WIDTHS[1:]]
        cells += [f"{ceiling(relative, a):.2f}x" for a in ACCEPTANCE]
        print(f"| {os.path.basename(path)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
