"""llama.cpp's fused CPU attention (flash) vs its plain attention ops, in our engine as served.

    .venv/bin/python scripts/flash_attention_ab.py [MODEL ...] [--rounds 2]

For each model, off and on interleaved per round (each a fresh process), prints the median
batch-1 decode step, the median 16-wide decode step, the prefill of 16 x 120 tokens, a
1,870-token prefill and the decode step after it (random prompt tokens, greedy, 32 KV slots).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(model: str, flash: bool) -> str:
    from ultrafast.llm import LLM
    from ultrafast.request import Request, SamplingParams

    llm = LLM(model, num_slots=32, flash_attn=flash)
    engine = llm.engine
    vocab = engine.executor.vocab_size
    rng = random.Random(0)

    def run(num: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for i in range(num):
            prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
            engine.add_request(Request(f"r{time.monotonic_ns()}-{i}", prompt, params))
        decode, prefill_s = [], 0.0
        while engine.has_work():
            t0 = time.perf_counter()
            engine.step()
            stats, took = engine.last_stats, time.perf_counter() - t0
            if stats.num_tokens == stats.num_seqs == num:
                decode.append(took)
            else:
                prefill_s += took
        decode.sort()
        return prefill_s * 1000, decode[len(decode) // 2] * 1000

    _, d1 = run(1, 120, 128)
    p16, d16 = run(16, 120, 64)
    plong, dlong = run(1, 1870, 16)
    llm.close()
    return (
        f"flash {'on ' if flash else 'off'} batch-1 decode {d1:.2f} ms | 16-wide decode "
        f"{d16:.1f} ms | 16 x 120 prefill {p16:.0f} ms | 1870 prefill {plong:.0f} ms, "
        f"decode after it {dlong:.2f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["models/demo-code"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # the child: one model, one setting, in a fresh process
        print(measure(args.models[0], args.one == "on"), flush=True)
        return
    for model in args.models:
        print(f"== {model}")
        for _ in range(args.rounds):
            for setting in ("off", "on"):
                cmd = [sys.executable, __file__, model, "--one", setting]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
