"""Where a speculative decode step's time goes: batch 1, priority tier, the demo model in-process.

    .venv/bin/python scripts/spec_step_split.py [--speculation ngram|draft|auto|off] [--threads N]
        [--model DIR_OR_GGUF]

Prints decode tok/s (median of 5 rounds of 128 tokens after a warm-up round), the mean split
of a step (propose / schedule / execute / sample / update, from the engine's StepStats) and,
per step width (tokens verified), the tokens it produced and its median execute time.
"""

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrafast.config import EngineConfig  # noqa: E402
from ultrafast.llm import build_engine  # noqa: E402
from ultrafast.request import Request, SamplingParams, ServiceTier  # noqa: E402
from ultrafast_harness.bench.server_process import DEMO_MODEL_DIR  # noqa: E402

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speculation", "--spec", default="ngram")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default=str(DEMO_MODEL_DIR), help="HF dir or .gguf")
    args = ap.parse_args()
    engine, tokenizer, _ = build_engine(
        EngineConfig(
            model=args.model,
            num_slots=4,
            max_num_seqs=4,
            max_model_len=512,
            n_threads=args.threads,
            speculation=args.speculation,
        )
    )
    engine.warmup()
    prompt = tokenizer.encode(PROMPT)
    steps, rates = [], []
    for r in range(args.rounds + 1):  # round 0 warms up
        engine.pool.reset_cache()
        engine.add_request(
            Request(
                f"r{r}",
                prompt,
                SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                tier=ServiceTier.PRIORITY,
            )
        )
        stamps = []
        first = True
        while engine.has_work():
            started = time.perf_counter()
            produced = sum(len(o.new_token_ids) for o in engine.step())
            elapsed = time.perf_counter() - started
            st = engine.last_stats
            if produced:
                stamps.append((time.perf_counter(), produced))
            if r and st.num_tokens and not first:  # decode steps only (not the prefill)
                steps.append(
                    (
                        st.num_tokens,
                        produced,
                        elapsed,
                        st.propose_time_s,
                        st.schedule_time_s,
                        st.execute_time_s,
                        st.sample_time_s,
                        st.update_time_s,
                    )
                )
            first = False
        if r:
            rates.append(sum(n for _, n in stamps[1:]) / (stamps[-1][0] - stamps[0][0]))
    engine.executor.close()
    n = len(steps)
    mean = [1000 * sum(s[k] for s in steps) / n for k in range(2, 8)]
    print(
        f"--speculation {args.speculation}, {args.threads} threads: "
        f"decode {statistics.median(rates):.0f} tok/s"
        f" (median of {args.rounds} rounds)"
    )
    print(
        f"{n} steps, {sum(s[1] for s in steps) / n:.2f} tokens out per step; step "
        f"{mean[0]:.3f} ms = propose {mean[1]:.3f} + schedule {mean[2]:.3f} + execute "
        f"{mean[3]:.3f} + sample {mean[4]:.3f} + update {mean[5]:.3f} (+ the rest)"
    )
    by_width = collections.defaultdict(list)
    for s in steps:
        by_width[s[0]].append(s)
    for width in sorted(by_width):
        group = by_width[width]
        print(
            f"  {width:2d} tokens verified: {len(group):4d} steps, "
            f"{statistics.mean(s[1] for s in group):.2f} out, execute "
            f"{1000 * statistics.median(s[5] for s in group):.3f} ms"
        )


if __name__ == "__main__":
    main()
