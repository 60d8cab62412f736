"""Where a constrained decode step's time goes, against the same request unconstrained.

Wraps the engine's step phases (the grammar's drafts and masks, scheduling, the forward pass,
sampling, the update) with timers and runs `ultrafast bench grammar`'s batch-1 request
(an endless JSON array of integers) constrained and free, interleaved, on one engine. Prints
the median microseconds per step of each phase. Also runs the free request's tokens under a
grammar that allows everything (`any`): same tokens, the grammar's bookkeeping only; and the
free request with llguidance's own per-token calls beside it (`bare`: after each step a raw
matcher consumes the next token of the constrained run's output and computes its mask into a
buffer nobody reads): what llguidance costs between real forward passes, with no code of ours,
the floor of any integration of it on this model and machine.

    python scripts/grammar_step_phases.py [MODEL] [--rounds 5] [--tokens 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ultrafast.engine import grammar_steps
from ultrafast.grammar import GrammarSpec
from ultrafast.llm import LLM
from ultrafast.request import Request, SamplingParams
from ultrafast.sampling import sampler
from ultrafast_harness.bench.grammar import ENDLESS, PROMPT

ANY = GrammarSpec("%llguidance {}\nstart: TEXT\nTEXT: /(.|\\n)*/\n")


class PhaseTimer:
    def __init__(self) -> None:
        self.ns: dict[str, int] = {}

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ns[label] = self.ns.get(label, 0) + time.perf_counter_ns() - start

        setattr(owner, name, timed)


def one_request(
    llm, timer: PhaseTimer, grammar, tokens: int, bare: list[int] | None = None
) -> tuple[int, int, dict, list[int]]:
    """`bare`: a constrained run's tokens, walked by a raw llguidance matcher beside a free
    request (see the module's docstring)."""
    timer.ns.clear()
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, grammar=grammar)
    engine.add_request(Request(f"r{time.monotonic_ns()}", llm.tokenizer.encode(PROMPT), params))
    shadow = buffer = None
    if bare is not None:
        shadow = engine.grammar.cache.new_matcher(ENDLESS)
        buffer = np.zeros(((engine.grammar.vocab_size + 31) // 32,), dtype=np.int32)
    out: list[int] = []
    steps = 0
    start = time.perf_counter_ns()
    while engine.has_work():
        for o in engine.step():
            out += o.new_token_ids
        if shadow is not None:
            t = time.perf_counter_ns()
            if steps < len(bare):
                shadow.consume_token(bare[steps])
            shadow.unsafe_compute_mask_ptr(buffer.ctypes.data, buffer.nbytes)
            timer.ns["llguidance"] = timer.ns.get("llguidance", 0) + time.perf_counter_ns() - t
        steps += 1
    return steps, time.perf_counter_ns() - start, dict(timer.ns), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="models/demo-code")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    llm = LLM(args.model, speculation="off", num_slots=1, max_num_seqs=1)
    timer = PhaseTimer()
    engine = llm.engine
    timer.wrap(grammar_steps, "constrain_drafts", "drafts")
    timer.wrap(grammar_steps, "fill_masks", "masks")
    timer.wrap(grammar_steps, "advance", "advance")
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "update", "update")
    timer.wrap(engine.executor, "execute", "execute")
    timer.wrap(sampler, "_greedy_under_masks", "masked argmax")
    runs: dict[str, list] = {"free": [], "bare": [], "any": [], "json": []}
    grammars = {"free": None, "bare": None, "any": ANY, "json": ENDLESS}
    walk = one_request(llm, timer, ENDLESS, args.tokens)[3]  # warm: compiles, cost model
    for grammar in grammars.values():
        one_request(llm, timer, grammar, args.tokens)
    for _ in range(args.rounds):
        for name, grammar in grammars.items():
            bare = walk if name == "bare" else None
            runs[name].append(one_request(llm, timer, grammar, args.tokens, bare)[:3])
    llm.close()
    print(f"model {args.model}, {args.tokens} tokens, median of {args.rounds} rounds, us/step")
    for name, results in runs.items():
        labels = sorted({k for _, _, ns in results for k in ns})
        per_step = {
            k: statistics.median(ns.get(k, 0) / steps / 1e3 for steps, _, ns in results)
            for k in labels
        }
        total = statistics.median(t / steps / 1e3 for steps, t, _ in results)
        cells = " ".join(f"{k}={v:.1f}" for k, v in per_step.items())
        print(f"{name:5s} steps={results[0][0]} total={total:.1f} {cells}")


if __name__ == "__main__":
    main()
