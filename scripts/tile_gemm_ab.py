"""Decode steps with the AMX tile GEMM (packed_linear.TILES) where `time_gemms` chose it, and
with oneDNN's products in its place, alternated in one process (the machine's drift hits both
alike), over KV the slots wrote (an unwritten mirror page reads as the kernel's zero page and
makes the attention look cheaper than it is):

    .venv/bin/python scripts/tile_gemm_ab.py [--slots 16] [--positions 300] [--rounds 20]

prints the median milliseconds of a step under each, and whether the logits are equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ultrafast.executors import wide_decode  # noqa: E402
from ultrafast.executors import wide_forward as wf  # noqa: E402
from ultrafast.executors.packed_linear import TILES, Weight  # noqa: E402

GGUF = REPO / "runs" / "models" / "smollm2" / "SmolLM2-135M-Instruct.bf16.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=str(GGUF))
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--positions", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    fw = wf.WideForward(args.gguf, 4096)
    fw.warm_gemms(wf.gemm_row_counts(1024, 32))
    fw.time_gemms()
    print(fw.gemm_status)
    weights = [getattr(layer, kind) for layer in fw.layers for kind in wf.GEMM_KINDS]
    weights += [fw.lm_head] if isinstance(fw.lm_head, Weight) else []
    chosen = [dict(w.kernels) for w in weights]
    mirror = wide_decode.new_mirror(fw, 4096, args.slots)
    slots, length = list(range(args.slots)), args.positions
    with torch.inference_mode():
        for slot in slots:  # written pages: the attention reads real memory
            mirror.reserve(slot, length + 1)
            for keys, values in zip(mirror.keys, mirror.values):
                keys[slot, :, :length] = 0.01
                values[slot, :, :length] = 0.01
    times: dict[bool, list[float]] = {False: [], True: []}
    logits: dict[bool, torch.Tensor] = {}
    for r in range(2 * args.rounds):
        tiles = r % 2 == 1
        for w, kernels in zip(weights, chosen):
            w.choose(kernels if tiles else {n: k for n, k in kernels.items() if k != TILES})
        for slot in slots:
            mirror.lens[slot] = length
        started = time.perf_counter()
        out = wide_decode.step_logits(
            fw, mirror, None, ([5] * len(slots), slots, [length] * len(slots))
        )
        times[tiles].append((time.perf_counter() - started) * 1e3)
        logits[tiles] = out
    for tiles in (False, True):
        name = "tiles where chosen" if tiles else "oneDNN only"
        print(f"{name}: median {statistics.median(times[tiles]):.2f} ms a step")
    print("logits equal:", torch.equal(logits[False], logits[True]))


if __name__ == "__main__":
    main()
