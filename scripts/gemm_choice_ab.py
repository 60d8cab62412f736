"""The wide passes' GEMM choice with and without one kernel, whole steps alternated in one
process (the machine's drift hits both alike): `WideForward.time_gemms` runs twice, once with
--without's copies never made (so it is never a candidate), once with every kernel; then
`wide_decode.step_logits` times a prefill chunk of --prefill tokens, the same with 15 decodes
riding, and a 16-slot decode step at --positions, each choice in turn, --rounds times:

    .venv/bin/python scripts/gemm_choice_ab.py [--without packed-one-row] [--rounds 8]

prints the median milliseconds of each step under each choice, and each GEMM kind's share.
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ultrafast.executors import packed_linear as pl  # noqa: E402
from ultrafast.executors import wide_decode  # noqa: E402
from ultrafast.executors import wide_forward as wf  # noqa: E402

DEFAULT = REPO / "runs/models/smollm2/SmolLM2-135M-Instruct.bf16.gguf"


def timed_choice(fw: wf.WideForward, counts: list[int], without: str | None) -> dict:
    """`fw`'s kernels per kind and row count, timed with every copy but `without`'s."""
    real = pl.Weight.copy_for

    def copy_for(self: pl.Weight, kernel: str) -> None:
        if kernel != without:
            real(self, kernel)

    pl.Weight.copy_for = copy_for  # type: ignore[method-assign]
    try:
        for layer in fw.layers:
            for kind in wf.GEMM_KINDS:
                getattr(layer, kind).choose({})
        fw._kernels = {}
        fw.warm_gemms(counts)
        fw.time_gemms()
    finally:
        pl.Weight.copy_for = real  # type: ignore[method-assign]
    print(f"{f'without {without}' if without else 'every kernel'}: {fw.gemm_status}", flush=True)
    return copy.deepcopy(fw._kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT))
    parser.add_argument("--without", default=pl.PACKED_ONE_ROW, choices=[*pl.COPIED])
    parser.add_argument("--prefill", type=int, default=1010)
    parser.add_argument("--positions", type=int, default=1100)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    fw = wf.WideForward(args.model, 4096)
    counts = wf.gemm_row_counts(1024, 32)
    choices = {
        f"without {args.without}": timed_choice(fw, counts, args.without),
        "every kernel": timed_choice(fw, counts, None),
    }
    mirror = wide_decode.new_mirror(fw, 4096, 32)
    decoding = list(range(16, 32))
    with torch.inference_mode():
        for slot in decoding:
            mirror.reserve(slot, args.positions + 8)
            for t in mirror.keys + mirror.values:
                t[slot, :, : args.positions + 8].normal_()  # written: real pages, not zero ones
    spent: dict[str, float] = collections.defaultdict(float)
    kind_of = {id(getattr(layer, k)): k for layer in fw.layers for k in wf.GEMM_KINDS}
    real_linear = wf.linear

    def linear(x, weight, bias=None):
        started = time.perf_counter()
        out = real_linear(x, weight, bias)
        spent[kind_of.get(id(weight), "head")] += time.perf_counter() - started
        return out

    wf.linear = linear  # type: ignore[assignment]
    wide_decode.linear = linear  # type: ignore[assignment]

    def step(riding: int) -> float:
        mirror.reserve(1, 1024)
        mirror.lens[1] = 0
        n = args.prefill if riding == 0 else min(args.prefill, 1024 - riding)
        prefill = (list(range(100, 100 + n)), list(range(n)), [wf.SeqChunk(0, n, 0)], [1])
        slots = decoding[:riding]
        decodes = ([5] * riding, slots, [args.positions] * riding) if riding else None
        started = time.perf_counter()
        wide_decode.step_logits(fw, mirror, prefill, decodes, logits_of=[0])
        return (time.perf_counter() - started) * 1e3

    def decode() -> float:
        started = time.perf_counter()
        wide_decode.step_logits(fw, mirror, None, ([5] * 16, decoding, [args.positions] * 16))
        return (time.perf_counter() - started) * 1e3

    steps = {"prefill": lambda: step(0), "prefill + 15 decodes": lambda: step(15)}
    steps["decode 16"] = decode
    times = {name: collections.defaultdict(list) for name in choices}
    shares = {name: collections.defaultdict(float) for name in choices}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, kernels in choices.items():
                fw._kernels = kernels
                for layer in fw.layers:
                    fw._choose(layer)
                for label, run in steps.items():
                    run()  # once untimed: the first after a switch builds nothing new
                    spent.clear()
                    times[name][label].append(run())
                    for kind, seconds in spent.items():
                        shares[name][f"{label}: {kind}"] += seconds * 1e3 / args.rounds
    for name in choices:
        cells = [f"{label} {statistics.median(v):.1f}" for label, v in times[name].items()]
        print(f"{name}: " + ", ".join(cells) + " ms (medians)")
        print("  GEMMs, ms a step: " + ", ".join(f"{k} {v:.1f}" for k, v in shares[name].items()))


if __name__ == "__main__":
    main()
