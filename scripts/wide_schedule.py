"""An engine-like schedule on the wide executor alone, no server: N prompts of P tokens arrive at
once and each generates G tokens (greedy, EOS ignored); every step holds the running decodes
first, then FCFS prefill chunks up to 512 tokens (the engine's default budget):

    .venv/bin/python scripts/wide_schedule.py [--tree=DIR] [--prompts 16] [--prompt-tokens 1000]
        [--new-tokens 32] [--runs 2] [--vary 0.2] [--model GGUF]

prints one JSON line per run: wall seconds, tok/s, median time to a prompt's first token, steps.
Why: through the server, 16 streams ran within +-20% of each other from run to run on the 2-core
Xeon (the client and the event loop share the cores), so a before/after of the executor's own
work needs this: run it with `--tree` on each checkout in turn (each process imports that
checkout's `ultrafast`), alternating.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_TREE = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tree=")), None)
sys.path.insert(0, _TREE or str(Path(__file__).resolve().parent.parent))

from ultrafast.core.types import ScheduledSeq, StepPlan  # noqa: E402
from ultrafast.executors.wide_exec import WideGgmlExecutor  # noqa: E402
from ultrafast.request import SamplingParams  # noqa: E402

DEFAULT = Path(__file__).resolve().parent.parent / (
    "runs/models/smollm2/SmolLM2-135M-Instruct.bf16.gguf"
)
BUDGET = 512


def step_plan(prompts, done: list[int], out: list[list[int]], params) -> list[ScheduledSeq]:
    """The running decodes, then prefill chunks in arrival order within the token budget."""
    budget, seqs = BUDGET, []
    for i, tokens in enumerate(out):
        if tokens and len(tokens) < params.max_tokens:
            position = len(prompts[i]) + len(tokens) - 1
            seqs.append(ScheduledSeq(f"r{i}", i, tokens[-1:], position, 1, params, 0, 0))
            budget -= 1
    for i, prompt in enumerate(prompts):
        if done[i] < len(prompt) and budget > 0:
            n = min(budget, len(prompt) - done[i])
            samples = 1 if done[i] + n == len(prompt) else 0
            chunk = prompt[done[i] : done[i] + n]
            seqs.append(ScheduledSeq(f"r{i}", i, chunk, done[i], samples, params, 0, 0))
            done[i] += n
            budget -= n
    return seqs


def run(ex, prompts, new_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for slot in range(len(prompts)):
        ex._trim_slot(slot, 0)
    done, out = [0] * len(prompts), [[] for _ in prompts]
    first: list[float] = []
    start, steps = time.perf_counter(), 0
    while any(len(tokens) < new_tokens for tokens in out):
        seqs = step_plan(prompts, done, out, params)
        result = ex.execute(StepPlan(seqs))
        assert not result.errors, result.errors
        steps += 1
        for seq in seqs:
            if seq.num_logits:
                i = int(seq.request_id[1:])
                if not out[i]:
                    first.append(time.perf_counter() - start)
                out[i] += result.sampled_token_ids[seq.request_id]
    wall = time.perf_counter() - start
    return {
        "wall_s": round(wall, 2),
        "tok_s": round(len(prompts) * new_tokens / wall, 1),
        "first_token_p50_s": round(sorted(first)[len(first) // 2], 2),
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", help="=DIR: run that checkout's code (read before imports)")
    parser.add_argument("--model", default=str(DEFAULT))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--vary", type=float, default=0.0, help="prompt lengths spread by +-this fraction"
    )
    args = parser.parse_args()
    ex = WideGgmlExecutor(
        args.model,
        num_slots=max(32, args.prompts),
        max_model_len=2048,
        n_threads=args.threads,
        max_num_batched_tokens=BUDGET,
        flash_attn=True,
        wide_pass="on",
    )
    vocab = ex.vocab_size - 10
    lengths = [  # a fixed spread: the same lengths in every run and checkout
        round(args.prompt_tokens * (1 + args.vary * ((i * 37 % 17) / 8 - 1)))
        for i in range(args.prompts)
    ]
    prompts = [[(i * 131 + j * 7 + 3) % vocab + 5 for j in range(n)] for i, n in enumerate(lengths)]
    with ex:
        for _ in range(args.runs):
            row = run(ex, prompts, args.new_tokens)
            print(json.dumps({**vars(args), "tree": _TREE or "this checkout", **row}), flush=True)


if __name__ == "__main__":
    main()
