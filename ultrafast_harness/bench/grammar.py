"""`ultrafast bench grammar`: what constrained decoding costs, in-process (no HTTP).

1. Time per output token, constrained vs the same request unconstrained, at batch 1 and at
   `--concurrency` requests in one batch. The grammar (a JSON array that needs more items than
   `--new-tokens` can hold) never lets a request finish early, and the free request ignores
   EOS, so both make exactly `--new-tokens` tokens. Rounds alternate the two, so a shared
   machine's drift hits both alike; the cost is the median of the per-round ratios.
2. TTFT of a request with a first-seen ~10 KB schema (compiled on a thread while the request
   prefills, as the server does), with the same schema cached, and with no schema; plus the
   bare compile time; and first-seen vs none with a long prompt (new to the prefix cache),
   whose prefill the compile overlaps.
`--served` measures the TTFT half through the server instead (bench/grammar_served.py).
Run it on a quiet machine: the figures are small differences of step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from ultrafast.grammar import GrammarSpec
from ultrafast.request import Request, SamplingParams
from ultrafast_harness.bench.grammar_inputs import big_schema, long_prompt
from ultrafast_harness.bench.report import write_report
from ultrafast_harness.bench.suite_args import (
    add_model,
    add_new_tokens,
    add_out,
    add_rounds,
    add_threads,
)

PROMPT = "Numbers as JSON:\n"
# more items than any run's tokens: the grammar never completes, so no request ends early
ENDLESS = GrammarSpec.from_json_schema(
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 5000}
)


_COMPILE_THREAD = ThreadPoolExecutor(1, thread_name_prefix="bench-grammar-compile")


def _decode_tpot(llm, num_requests: int, new_tokens: int, grammar) -> float:
    """Mean seconds per output token after the first, over `num_requests` batched requests."""
    tok = llm.tokenizer
    ids = tok.encode(PROMPT)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i in range(num_requests):
        params = SamplingParams(
            max_tokens=new_tokens, temperature=0.0, ignore_eos=grammar is None, grammar=grammar
        )
        llm.engine.add_request(Request(f"b{i}-{time.monotonic_ns()}", ids, params))
    while llm.engine.has_work():
        outs = llm.engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
    per = [(last[r] - first[r]) / max(1, counts[r] - 1) for r in first]
    return statistics.mean(per)


def _ttft(llm, grammar, prompt: str = PROMPT) -> float:
    tok = llm.tokenizer
    params = SamplingParams(max_tokens=1, temperature=0.0, grammar=grammar)
    start = time.perf_counter()
    pending = None
    if grammar is not None:  # what the server does: compile on a thread, prefill meanwhile
        pending = llm.engine.grammar.start_compile(grammar, _COMPILE_THREAD)
    request = Request(f"t-{time.monotonic_ns()}", tok.encode(prompt), params)
    request.grammar_pending = pending
    llm.engine.add_request(request)
    while llm.engine.has_work():
        if any(o.new_token_ids for o in llm.engine.step()):
            break
    elapsed = time.perf_counter() - start
    while llm.engine.has_work():
        llm.engine.step()
    return elapsed


def run(llm, new_tokens: int, rounds: int, concurrency: int) -> dict:
    report: dict = {"new_tokens": new_tokens, "rounds": rounds, "concurrency": concurrency}
    _decode_tpot(llm, 1, min(new_tokens, 8), ENDLESS)  # warm both paths
    for batch in (1, concurrency):
        free, constrained, ratios = [], [], []
        for _ in range(rounds):
            f = _decode_tpot(llm, batch, new_tokens, None)
            c = _decode_tpot(llm, batch, new_tokens, ENDLESS)
            free.append(f)
            constrained.append(c)
            ratios.append(c / f)
        report[f"batch_{batch}"] = {
            "free_ms_per_token": statistics.median(free) * 1000,
            "constrained_ms_per_token": statistics.median(constrained) * 1000,
            "overhead_pct": (statistics.median(ratios) - 1) * 100,
        }
    runtime = llm.engine.grammar
    compile_ms, cached_ms, ttft_none, ttft_first, ttft_cached = [], [], [], [], []
    long_none: list[float] = []  # the same with a long prompt, whose prefill hides the compile
    long_first: list[float] = []
    for r in range(rounds):
        spec = GrammarSpec.from_json_schema(big_schema(r * 1000 + time.monotonic_ns() % 997))
        t0 = time.perf_counter()
        runtime.compile(spec)
        compile_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        runtime.compile(spec)
        cached_ms.append((time.perf_counter() - t0) * 1000)
        ttft_none.append(_ttft(llm, None) * 1000)
        fresh = GrammarSpec.from_json_schema(big_schema(r * 1000 + 500 + time.monotonic_ns() % 97))
        ttft_first.append(_ttft(llm, fresh) * 1000)
        ttft_cached.append(_ttft(llm, fresh) * 1000)
        long_none.append(_ttft(llm, None, long_prompt()) * 1000)
        fresh = GrammarSpec.from_json_schema(big_schema(r * 1000 + 700 + time.monotonic_ns() % 97))
        long_first.append(_ttft(llm, fresh, long_prompt()) * 1000)
    report["schema_bytes"] = len(json.dumps(big_schema(0)))
    report["compile"] = {
        "first_ms": statistics.median(compile_ms),
        "cached_ms": statistics.median(cached_ms),
        "ttft_no_schema_ms": statistics.median(ttft_none),
        "ttft_first_seen_schema_ms": statistics.median(ttft_first),
        "ttft_cached_schema_ms": statistics.median(ttft_cached),
        "long_prompt_tokens": len(llm.tokenizer.encode(long_prompt())),
        "ttftlong_prompt_no_schema_ms": statistics.median(long_none),
        "ttftlong_prompt_first_seen_schema_ms": statistics.median(long_first),
    }
    return report


def markdown(report: dict) -> str:
    lines = [
        "| batch | free ms/token | constrained ms/token | overhead |",
        "|---|---|---|---|",
    ]
    for batch in (1, report["concurrency"]):
        row = report[f"batch_{batch}"]
        lines.append(
            f"| {batch} | {row['free_ms_per_token']:.2f} | {row['constrained_ms_per_token']:.2f}"
            f" | {row['overhead_pct']:+.1f}% |"
        )
    c = report["compile"]
    lines += [
        "",
        f"{report['schema_bytes']} B schema: compile {c['first_ms']:.2f} ms first, "
        f"{c['cached_ms']:.3f} ms cached; TTFT {c['ttft_no_schema_ms']:.1f} ms without a "
        f"schema, {c['ttft_first_seen_schema_ms']:.1f} ms first-seen, "
        f"{c['ttft_cached_schema_ms']:.1f} ms cached; with a {c['long_prompt_tokens']}-token "
        f"prompt {c['ttftlong_prompt_no_schema_ms']:.1f} ms without a schema, "
        f"{c['ttftlong_prompt_first_seen_schema_ms']:.1f} ms first-seen",
    ]
    return "\n".join(lines)


def main(args) -> int:
    if args.served:  # the same TTFT figures through the server: bench/grammar_served.py
        from ultrafast_harness.bench import grammar_served

        return grammar_served.main(args)
    from ultrafast.llm import LLM

    n = max(1, args.concurrency)
    options = {"speculation": "off", "num_slots": n, "max_num_seqs": n}
    if args.threads:
        options["n_threads"] = args.threads
    llm = LLM(args.model, **options)
    try:
        if llm.engine.grammar is None:
            raise SystemExit("constrained decoding is not available for this model")
        report = run(llm, args.new_tokens, args.rounds, n)
    finally:
        llm.close()
    report["model"] = str(args.model)
    return write_report(report, args.out, markdown(report))


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench grammar --help`)."""
    add_model(p, "HF model directory or .gguf file")
    add_new_tokens(p, "tokens per request")
    add_rounds(p, 3)
    add_threads(p, "kernel threads (default: all cores)")
    p.add_argument(
        "--concurrency", type=int, default=16, help="requests per batch, 2nd row (default 16)"
    )
    p.add_argument(
        "--served",
        action="store_true",
        help="first-seen / cached schema TTFT through a server instead (streamed chat calls)",
    )
    add_out(p, "runs/bench_grammar.json")
