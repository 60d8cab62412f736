"""`ultrafast bench models`: the model-swap benchmark (issue 20, part 4).

Two models served by one `ultrafast serve --models a=...,b=...` whose `--max-resident-bytes`
fits the larger one but not both, so every switch of model is an eviction and a load.

1. Swap cost: calls alternate a, b, a, b, ... (`--swaps` switches); each switching call's
   latency minus the same model's warm latency (a second call in a row) is the swap cost,
   set beside the server's own measured load time of that model (`load_s` in /v1/models).
   Target: the swap costs no more than the load (plus noise).
2. Preloading: a replayed periodic trace (a at k*P, b at k*P + P/2, `--cycles` cycles) on a
   fresh server with preloading and on one with `--no-preload`; cold calls (a call that found
   its model unloaded: `ultrafast_model_cold_calls_total`) with vs without. Target: preloading
   cuts them by 80% or more. The predictor needs a few calls of each model to see the
   pattern, so the steady state (after `--warmup-cycles`) is reported too.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import httpx

from ultrafast_harness.bench.report import write_report
from ultrafast_harness.bench.suite_args import add_out, add_server_slots, add_threads

PROMPT = "def fibonacci(n):"


def default_models() -> str:
    """The demo model and SmolLM2 when `make setup` fetched it, else the demo draft."""
    from ultrafast.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR, smollm2_gguf

    second = smollm2_gguf()
    if second.is_file():
        return f"demo={DEMO_MODEL_DIR},smollm2={second}"
    return f"demo={DEMO_MODEL_DIR},draft={DEMO_DRAFT_DIR}"


def call(client: httpx.Client, model: str, max_tokens: int) -> float:
    """Seconds for one small greedy completion (the whole call: load, prefill, decode)."""
    started = time.perf_counter()
    r = client.post(
        "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0},
    )
    r.raise_for_status()
    return time.perf_counter() - started


def models_info(client: httpx.Client) -> dict[str, dict]:
    return {m["id"]: m for m in client.get("/v1/models").json()["data"]}


def counter(client: httpx.Client, name: str) -> float:
    """One unlabelled sample of /metrics."""
    match = re.search(rf"^{name} ([0-9.e+-]+)$", client.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def start_server(models: str, budget: int, args, *extra: str):
    from ultrafast_harness.bench.server_process import ServerProcess

    return ServerProcess(
        "--models",
        models,
        "--max-resident-bytes",
        str(budget),
        "--priority-ttft-ms",
        "60000",
        *(["--threads", str(args.threads)] if args.threads else []),
        *extra,
        model=None,
        num_slots=args.num_slots,
        max_model_len=args.max_model_len,
    )


def swap_costs(url: str, names: list[str], args) -> dict:
    with httpx.Client(base_url=url, timeout=300) as client:
        warm: dict[str, list[float]] = {n: [] for n in names}
        swap: dict[str, list[float]] = {n: [] for n in names}
        load: dict[str, list[float]] = {n: [] for n in names}
        call(client, names[0], args.max_tokens)  # the default model, loaded at start
        for i in range(args.swaps):
            name = names[(i + 1) % 2]
            swap[name].append(call(client, name, args.max_tokens))
            load[name].append(models_info(client)[name]["load_s"])
            warm[name].append(call(client, name, args.max_tokens))
    rows = {}
    for n in names:
        if not swap[n]:
            continue
        warm_s = statistics.median(warm[n])
        rows[n] = {
            "swaps": len(swap[n]),
            "warm_call_s": warm_s,
            "swap_call_s": statistics.median(swap[n]),
            "swap_cost_s": statistics.median(s - warm_s for s in swap[n]),
            "load_s": statistics.median(load[n]),
        }
    return rows


def replay_trace(url: str, names: list[str], period_s: float, args) -> dict:
    """a at k*P, b at k*P + P/2; cold calls in all and after the warm-up cycles."""
    with httpx.Client(base_url=url, timeout=300) as client:
        start = time.monotonic()
        latencies, cold_after_warmup, cold_at_warmup = [], 0.0, 0.0
        for k in range(args.cycles):
            if k == args.warmup_cycles:
                cold_at_warmup = counter(client, "ultrafast_model_cold_calls_total")
            for j, name in enumerate(names):
                target = start + k * period_s + j * period_s / 2
                time.sleep(max(0.0, target - time.monotonic()))
                latencies.append(call(client, name, args.max_tokens))
        cold = counter(client, "ultrafast_model_cold_calls_total")
        if args.cycles > args.warmup_cycles:
            cold_after_warmup = cold - cold_at_warmup
        return {
            "calls": len(latencies),
            "cold_calls": cold,
            "cold_calls_after_warmup": cold_after_warmup,
            "preloads": counter(client, "ultrafast_model_preloads_total"),
            "preload_hits": counter(client, "ultrafast_model_preload_hits_total"),
            "p50_call_s": statistics.median(latencies),
            "max_call_s": max(latencies),
        }


def _cut(without: float, with_: float) -> float | None:
    return None if without <= 0 else 1.0 - with_ / without


def main(args) -> int:
    from ultrafast.config_flags import parse_models_arg
    from ultrafast.model_files import resolve_model
    from ultrafast.server.residency.budget import resident_bytes

    models = args.models or default_models()
    pairs = parse_models_arg([models])
    if len(pairs) != 2:
        raise ValueError("--models: give exactly two NAME=PATH")
    names = [n for n, _ in pairs]
    sizes = [resident_bytes(resolve_model(p), args.num_slots, args.max_model_len) for _, p in pairs]
    budget = max(sizes) + 1  # one of them, never both
    srv = start_server(models, budget, args, "--no-preload", "--keep-alive", "-1")
    try:
        swaps = swap_costs(srv.url, names, args)
    finally:
        srv.stop()
    slowest = max(row["swap_call_s"] for row in swaps.values())
    period_s = args.period_s or round(max(1.0, 4 * slowest), 2)
    trace = {}
    for mode, extra in (("without_preload", ("--no-preload",)), ("with_preload", ())):
        srv = start_server(models, budget, args, "--keep-alive", "-1", *extra)
        try:
            trace[mode] = replay_trace(srv.url, names, period_s, args)
        finally:
            srv.stop()
    without, with_ = trace["without_preload"], trace["with_preload"]
    report = {
        "models": dict(zip(names, [p for _, p in pairs], strict=True)),
        "resident_bytes": dict(zip(names, sizes, strict=True)),
        "budget_bytes": budget,
        "swap": swaps,
        "trace_period_s": period_s,
        "trace": trace,
        "cold_call_cut": _cut(without["cold_calls"], with_["cold_calls"]),
        "cold_call_cut_after_warmup": _cut(
            without["cold_calls_after_warmup"], with_["cold_calls_after_warmup"]
        ),
    }
    lines = [
        f"models {', '.join(f'{n} ({s / 1e6:.1f} MB)' for n, s in zip(names, sizes, strict=True))};"
        f" budget {budget / 1e6:.1f} MB (one of them)",
        "",
        "| model | warm call | switching call | swap cost | load time (server) |",
        "|---|---|---|---|---|",
    ]
    for n, row in swaps.items():
        lines.append(
            f"| {n} | {row['warm_call_s'] * 1000:.0f} ms | {row['swap_call_s'] * 1000:.0f} ms | "
            f"{row['swap_cost_s'] * 1000:.0f} ms | {row['load_s'] * 1000:.0f} ms |"
        )
    lines += [
        "",
        f"periodic trace: {args.cycles} cycles, period {period_s} s "
        f"(steady state after {args.warmup_cycles} cycles)",
        "",
        "| preloading | calls | cold calls | cold after warm-up | preloads | p50 call | max call |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, row in trace.items():
        lines.append(
            f"| {mode.replace('_', ' ')} | {row['calls']} | {row['cold_calls']:.0f} | "
            f"{row['cold_calls_after_warmup']:.0f} | {row['preloads']:.0f} | "
            f"{row['p50_call_s'] * 1000:.0f} ms | {row['max_call_s'] * 1000:.0f} ms |"
        )
    cut, steady = report["cold_call_cut"], report["cold_call_cut_after_warmup"]
    lines.append(
        f"\ncold calls cut by preloading: {'n/a' if cut is None else f'{cut:.0%}'} in all, "
        f"{'n/a' if steady is None else f'{steady:.0%}'} after warm-up (target >= 80%)"
    )
    return write_report(report, args.out, "\n".join(lines))


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench models --help`)."""
    p.add_argument(
        "--models",
        default=None,
        metavar="A=PATH,B=PATH",
        help="the two models (default: the demo model and SmolLM2 when fetched, else the "
        "demo draft)",
    )
    add_server_slots(p)
    p.add_argument("--max-model-len", type=int, default=512, help="positions per slot")
    add_threads(p, "the server's --threads (default: the serve default)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per call (default 8)")
    p.add_argument("--swaps", type=int, default=8, help="model switches timed (default 8)")
    p.add_argument("--cycles", type=int, default=20, help="periodic trace cycles (default 20)")
    p.add_argument(
        "--warmup-cycles",
        type=int,
        default=4,
        help="cycles before the steady state is counted (the predictor learns; default 4)",
    )
    p.add_argument(
        "--period-s",
        type=float,
        default=0.0,
        help="trace period (0 = 4x the slowest switching call, at least 1 s)",
    )
    add_out(p, "runs/bench_models.json")
