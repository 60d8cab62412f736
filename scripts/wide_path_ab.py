"""The wide path's torch passes, an earlier revision's against this checkout's, interleaved in
one process (best of N each), so the machine's drift hits both alike:

    .venv/bin/python scripts/wide_path_ab.py [--before fdff267] [--threads 2] [--rounds 25]
        [--slots 16] [--positions 200] [--model GGUF]

times `wide_decode.decode_logits` (a decode step of --slots sequences at about --positions)
and `WideForward.kv` (a prefill of 5 x 102 tokens), and prints the largest difference of the
two revisions' outputs. The earlier revision's `wide_forward.py` and `wide_decode.py` are read
with `git show` into a temporary directory; everything else is this checkout's.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ultrafast.executors import wide_decode, wide_forward  # noqa: E402

DEFAULT = REPO / "runs/models/smollm2/SmolLM2-135M-Instruct.bf16.gguf"


def old_modules(rev: str, tmp: Path):
    """The revision's wide_forward and wide_decode, the latter importing the former."""
    modules = []
    for name in ("wide_forward", "wide_decode"):
        text = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:ultrafast/executors/{name}.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        text = text.replace("ultrafast.executors.wide_forward", "old_wide_forward")
        path = tmp / f"old_{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"old_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"old_{name}"] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def best_of(rounds: int, runs: dict) -> dict[str, float]:
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def decode_runner(decode, fw, slots: int, positions: int):
    mirror = decode.new_mirror(fw, positions + 64)
    for s in range(slots):
        mirror.reserve(s, positions + slots + 1)
        mirror.lens[s] = positions + s
    ids, pos, tokens = list(range(slots)), [positions + s for s in range(slots)], [100] * slots

    def run():
        out = decode.decode_logits(fw, mirror, tokens, ids, pos)
        for s, p in zip(ids, pos):
            mirror.trim(s, p)
        return out

    return run


def prefill_runner(forward, fw):
    n, t = 5, 102
    tokens = torch.randint(0, 40000, (n * t,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(t).repeat(n)
    seqs = [forward.SeqChunk(i * t, t, 0) for i in range(n)]
    return lambda: fw.kv(tokens, positions, seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="fdff267")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--positions", type=int, default=200)
    parser.add_argument("--model", type=Path, default=DEFAULT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        old_forward, old_decode = old_modules(args.before, Path(tmp))
        old_fw = old_forward.WideForward(args.model, 2048)
        new_fw = wide_forward.WideForward(args.model, 2048)
        decodes = {
            "before": decode_runner(old_decode, old_fw, args.slots, args.positions),
            "after": decode_runner(wide_decode, new_fw, args.slots, args.positions),
        }
        diff = (decodes["before"]() - decodes["after"]()).abs().max().item()
        step = best_of(args.rounds, decodes)
        print(
            f"decode step, {args.slots} slots at ~{args.positions} positions: "
            f"{step['before'] * 1e3:.1f} -> {step['after'] * 1e3:.1f} ms "
            f"(largest logit difference {diff:.3f})"
        )
        prefills = {
            "before": prefill_runner(old_forward, old_fw),
            "after": prefill_runner(wide_forward, new_fw),
        }
        took = best_of(max(3, args.rounds // 5), prefills)
        print(
            f"prefill 5 x 102 tokens: {510 / took['before']:.0f} -> {510 / took['after']:.0f} tok/s"
        )


if __name__ == "__main__":
    main()
