"""The wide passes' GEMM kernels side by side, per matrix kind and row count: oneDNN's packed
weight, the plain weight, the weight packed for a one-row batch, and the product in two row
halves (executors/packed_linear.py), each on 1 and 2 threads, interleaved, best of --rounds. A
kernel whose 2-thread time equals its 1-thread time runs the shape on one core while the other
waits.

    .venv/bin/python scripts/gemm_kernels.py [--model GGUF] [--rows 512,768,1024] [--rounds 5]

The halves here run each half on whichever kernel this run timed fastest at the half's row
count on 2 threads (the server's own choice is timed on its idle engine: its status line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ultrafast.executors import packed_linear as pl  # noqa: E402
from ultrafast.executors.wide_forward import GEMM_KINDS, WideForward  # noqa: E402

DEFAULT = REPO / "runs/models/smollm2/SmolLM2-135M-Instruct.bf16.gguf"


def best_ms(calls: dict, threads: int, rounds: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    time_call = pl._timer(calls[pl.PACKED])
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        best = {name: min(best[name], time_call(call)) for name, call in calls.items()}
    return {name: seconds * 1e3 for name, seconds in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT))
    ap.add_argument("--rows", default="256,512,768,1024")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    fw = WideForward(args.model, 64)
    first = fw.layers[0]
    with torch.inference_mode():
        for kind in GEMM_KINDS:
            w = getattr(first, kind)
            w.unpack()
            bias = first.qkv_bias if kind == "qkv" else None
            halves = sorted(
                {pl.half_rows(r) for r in rows_list} | {r - pl.half_rows(r) for r in rows_list}
            )
            pl.build(w, sorted(set(rows_list) | set(halves)), bias)
            fastest = {}
            for r in halves:
                t = best_ms(pl._calls(w, r, bias), 2, args.rounds)
                fastest[r] = min(t, key=t.__getitem__)
            w.choose(fastest)
            w.unpack()
            for rows in rows_list:
                calls = pl._calls(w, rows, bias, split=True)
                one, two = best_ms(calls, 1, args.rounds), best_ms(calls, 2, args.rounds)
                cells = "  ".join(f"{n} {one[n]:.3f}/{two[n]:.3f}" for n in calls)
                print(f"{kind:8s} {rows:5d} rows, ms on 1/2 threads: {cells}", flush=True)


if __name__ == "__main__":
    main()
