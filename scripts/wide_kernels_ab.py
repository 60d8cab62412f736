"""One of the wide forward's native kernels against the torch path it replaces, whole passes
interleaved in one process (the 3rd best of --rounds each), so the machine's drift hits both
alike: `fused` (the elementwise C ops, executors/fused_ops.py, against torch's ops) or
`prefill-attention` (the AMX kernel, executors/prefill_attention.py, against SDPA):

    .venv/bin/python scripts/wide_kernels_ab.py [--kernel fused] [--model GGUF] [--rounds 8]

times `wide_decode.step_logits` on a 512-token prefill (no earlier KV and after 488
positions), a 102-token prefill, and decode steps of 16 and 4 slots at 200 positions, and
prints each ratio with whether the greedy tokens agree and the largest logit difference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ultrafast.executors import wide_decode  # noqa: E402
from ultrafast.executors.wide_forward import SeqChunk, WideForward  # noqa: E402

KERNELS = {"fused": "fused", "prefill-attention": "prefill_kernel"}  # --kernel: its attribute
DEFAULT = REPO / "runs/models/smollm2/SmolLM2-135M-Instruct.bf16.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT), help="a GGUF the wide forward runs")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="fused")
    args = parser.parse_args()
    fw = WideForward(args.model, 2048)
    attribute = KERNELS[args.kernel]
    kernel = getattr(fw, attribute)
    if kernel is None:
        sys.exit(f"no {args.kernel} kernel to compare here: {fw.kernels_status}")
    mirror = wide_decode.new_mirror(fw, 2048, 32)

    def prefill(n: int, start: int, slot: int = 20):
        mirror.reserve(slot, start + n)
        mirror.lens[slot] = start
        rows = (list(range(100, 100 + n)), list(range(start, start + n)))
        chunk = [SeqChunk(0, n, start)]
        return wide_decode.step_logits(fw, mirror, (*rows, chunk, [slot]), None, logits_of=[0])

    def decode(width: int, start: int):
        slots = list(range(width))
        for s in slots:
            mirror.reserve(s, start + 1)
            mirror.lens[s] = start
        return wide_decode.decode_logits(fw, mirror, [100] * width, slots, [start] * width)

    cases = {
        "prefill 512 @ 0": lambda: prefill(512, 0),
        "prefill 512 @ 488": lambda: prefill(512, 488),
        "prefill 488 @ 1024": lambda: prefill(488, 1024),
        "prefill 102 @ 0": lambda: prefill(102, 0),
        "decode 16 @ 200": lambda: decode(16, 200),
        "decode 4 @ 200": lambda: decode(4, 200),
    }
    for name, run in cases.items():
        times: dict[str, list[float]] = {"kernel": [], "torch": []}
        outs = {}
        for _ in range(args.rounds):
            for mode in times:
                setattr(fw, attribute, kernel if mode == "kernel" else None)
                started = time.perf_counter()
                outs[mode] = run()
                times[mode].append(time.perf_counter() - started)
        ours, theirs = (sorted(times[m])[min(2, args.rounds - 1)] for m in ("kernel", "torch"))
        same = (outs["kernel"].argmax(-1) == outs["torch"].argmax(-1)).float().mean().item()
        diff = (outs["kernel"] - outs["torch"]).abs().max().item()
        print(
            f"{name}: {args.kernel} {ours * 1e3:.1f} ms, torch {theirs * 1e3:.1f} ms "
            f"({theirs / ours:.2f}x); argmax equal {same:.2f}, max logit diff {diff:.3f}"
        )
    setattr(fw, attribute, kernel)


if __name__ == "__main__":
    main()
