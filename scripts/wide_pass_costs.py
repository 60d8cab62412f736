"""Per-pass cost of the llama.cpp path and the wide path (executors/wide_exec.py) on one GGUF:

    .venv/bin/python scripts/wide_pass_costs.py [MODEL.gguf] [--threads 2] [--repeats 3]

prints, as JSON, median milliseconds of: 16 prompts x 102 tokens prefilled in steps of at most
512 tokens (5 + 5 + 5 + 1 prompts, as the engine's default token budget cuts them), one step
of 15 decodes plus one 102-token prompt, and decode steps of 1, 4 and 16 sequences (on the
wide path, steps from the decode width measured at start run in torch), each the whole
`execute()` including the KV moves and sampling. Default model:
runs/models/smollm2/SmolLM2-135M-Instruct.bf16.gguf. `--tree=DIR` times another checkout's
code (a before/after on the same machine, interleaved by running both in turn).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_TREE = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tree=")), None)
sys.path.insert(0, _TREE or str(Path(__file__).resolve().parent.parent))

from ultrafast.core.types import ScheduledSeq, StepPlan  # noqa: E402
from ultrafast.executors.wide_exec import WideGgmlExecutor  # noqa: E402
from ultrafast.request import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
DEFAULT = Path("runs/models/smollm2/SmolLM2-135M-Instruct.bf16.gguf")


def seq(slot: int, tokens: list[int], start: int) -> ScheduledSeq:
    return ScheduledSeq(f"s{slot}", slot, tokens, start, 1, GREEDY, 0, 0)


def timed(ex, plans: list[StepPlan], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        for plan in plans:
            result = ex.execute(plan)
            assert not result.errors, result.errors
        times.append(time.perf_counter() - start)
    return round(statistics.median(times[1:]) * 1e3, 1)


def measure(ex, wide: bool, repeats: int) -> dict[str, float]:
    ex._wide_paused = not wide
    vocab = ex.vocab_size
    prompts = [[(i * 131 + j * 7 + 3) % vocab for j in range(102)] for i in range(16)]
    prefill = [
        StepPlan([seq(i, prompts[i], 0) for i in range(s, min(s + 5, 16))]) for s in range(0, 16, 5)
    ]
    path = "wide" if wide else "llama.cpp"
    out = {"prefill_16x102_ms": timed(ex, prefill, repeats)}
    print(path, out, file=sys.stderr, flush=True)  # as it goes: a loaded machine is slow
    ctx = 102  # every slot now holds its 102-token prompt: decodes attend over it
    mixed = [seq(i, [5], ctx) for i in range(15)] + [seq(15, prompts[15], 0)]
    out["15_decodes_plus_102_prefill_ms"] = timed(ex, [StepPlan(mixed)], repeats)
    for width in (1, 4, 16):
        out[f"decode_{width}_ms"] = timed(
            ex, [StepPlan([seq(i, [5], ctx) for i in range(width)])], repeats
        )
    print(path, out, file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", default=str(DEFAULT))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tree", help="=DIR: time that checkout's code (read before imports)")
    args = parser.parse_args()
    ex = WideGgmlExecutor(
        args.gguf,
        num_slots=16,
        max_model_len=512,
        n_threads=args.threads,
        max_num_batched_tokens=512,
        flash_attn=True,
        wide_pass="on",
    )
    print(ex.wide_status, file=sys.stderr, flush=True)
    try:
        report = {
            "status": ex.wide_status,
            "llama_cpp": measure(ex, False, args.repeats),
            "wide": measure(ex, True, args.repeats),
        }
    finally:
        ex.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
