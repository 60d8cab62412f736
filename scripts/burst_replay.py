"""`ultrafast bench serve`'s irregular burst replayed in-process on the engine (no HTTP, no
client on the cores): the one-token requests' latency, and where the passes went.

Same schedule as the bench (64 one-token and 8 sixty-four-token requests at seeded moments
within 1 s, ~102-token prompts), fed to `EngineCore` as the moments come. Per round it prints
the short requests' p50 / p99, the forward-pass time of decode-only, mixed and prefill-only
steps, and the decode runs per step: how many runs of consecutive KV slots a step's decodes
fell into (llama.cpp runs one pass per run; see docs/ARCHITECTURE.md, "One forward pass per
run of consecutive slots").

    python scripts/burst_replay.py [--model demo|smollm2] [--rounds 4]
"""

from __future__ import annotations

import argparse
import collections
import random
import time

from ultrafast.llm import LLM
from ultrafast.request import Request, SamplingParams
from ultrafast_harness.bench.serve_bench import burst_schedule, resolve_bench_model


def decode_runs(slots: list[int]) -> int:
    slots = sorted(slots)
    return 1 + sum(1 for a, b in zip(slots, slots[1:]) if b != a + 1) if slots else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    model = resolve_bench_model(args.model, "auto")
    llm = LLM(str(model.gguf), speculation="off")
    engine = llm.engine
    rng = random.Random(0)
    stats: collections.Counter = collections.Counter()
    execute = engine.executor.execute

    def timed_execute(plan):
        result = execute(plan)
        decodes = [s.slot_id for s in plan.seqs if len(s.token_ids) == 1]
        prefill = any(len(s.token_ids) > 1 for s in plan.seqs)
        kind = "mixed" if decodes and prefill else ("decode" if decodes else "prefill")
        stats[kind + "_steps"] += 1
        stats[kind + "_s"] += result.execute_time_s
        if decodes:
            stats["decode_runs"] += decode_runs(decodes)
            stats["steps_with_decodes"] += 1
        return result

    engine.executor.execute = timed_execute
    vocab = engine.executor.vocab_size
    for rnd in range(args.rounds):
        stats.clear()
        pending = [
            (t, is_long, [rng.randrange(10, vocab - 1) for _ in range(102)], i)
            for i, (t, is_long) in enumerate(burst_schedule(64, 8, 1.0, seed=18))
        ]
        start = time.perf_counter()
        arrived: dict[str, float] = {}
        done: dict[str, float] = {}
        while pending or engine.has_work():
            now = time.perf_counter() - start
            while pending and pending[0][0] <= now:
                t, is_long, prompt, i = pending.pop(0)
                rid = f"{rnd}-{i}-{'long' if is_long else 'short'}"
                arrived[rid] = t
                params = SamplingParams(
                    max_tokens=64 if is_long else 1, temperature=0.0, ignore_eos=True
                )
                engine.add_request(Request(rid, prompt, params))
            if not engine.has_work():
                time.sleep(0.0005)
                continue
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = time.perf_counter() - start
        lat = sorted((done[r] - arrived[r]) * 1e3 for r in done if r.endswith("short"))
        runs = stats["decode_runs"] / max(1, stats["steps_with_decodes"])
        print(
            f"round {rnd}: wall {time.perf_counter() - start:.2f} s, short p50 "
            f"{lat[len(lat) // 2]:.0f} ms p99 {lat[int(len(lat) * 0.99) - 1]:.0f} ms; passes: "
            f"decode-only {stats['decode_steps']} steps {stats['decode_s']:.3f} s, mixed "
            f"{stats['mixed_steps']} {stats['mixed_s']:.3f} s, prefill-only "
            f"{stats['prefill_steps']} {stats['prefill_s']:.3f} s; {runs:.2f} decode runs a step"
        )
    llm.close()


if __name__ == "__main__":
    main()
