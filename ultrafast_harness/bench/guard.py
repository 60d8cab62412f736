"""What does the output safety filter cost? TTFT, inter-token gaps and streamed tokens/s over HTTP
with no guard, with the pattern guard and no hold-back (the cost of checking), and with the
pattern guard holding back N tokens (the cost a client sees), plus the guard's own CPU time per
token and the metrics' CPU time per engine step and per token, measured in-process. Servers
run one at a time on 127.0.0.1, in alternating order per round so drift in the machine's speed
spreads over all configurations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from ultrafast.engine.core import StepStats
from ultrafast.request import ServiceTier
from ultrafast.server.guard import GuardConfig, GuardedChoice, PatternGuard
from ultrafast.server.metrics import ServerMetrics
from ultrafast_harness.bench.report import write_report
from ultrafast_harness.bench.server_process import ServerProcess
from ultrafast_harness.bench.suite_args import (
    add_model,
    add_new_tokens,
    add_out,
    add_rounds,
    add_server_slots,
)
from ultrafast_harness.bench.tiers import PROMPT, percentile, stream_once

EXAMPLE_PATTERNS = Path(__file__).resolve().parents[2] / "deploy" / "guard-patterns.example.json"


def _configs(hold_back: int, patterns_file: Path) -> dict:
    guard = ["--guard-patterns", str(patterns_file)]
    return {
        "none": [],
        "guard_hold_0": guard + ["--guard-hold-back-tokens", "0"],
        f"guard_hold_{hold_back}": guard + ["--guard-hold-back-tokens", str(hold_back)],
    }


async def _probe(url: str, count: int, max_tokens: int) -> tuple[list, list, list]:
    ttfts, gaps, rates = [], [], []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await stream_once(
            client,
            {
                "prompt": PROMPT,
                "max_tokens": 8,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
            },
        )  # warm-up
        for i in range(count):
            start = time.perf_counter()
            ttft, g = await stream_once(
                client,
                {
                    "prompt": PROMPT + f"# probe {i}\n",
                    "max_tokens": max_tokens,
                    "stream": True,
                    "ignore_eos": True,
                    "temperature": 0,
                    "service_tier": "priority",
                },
            )
            total_s = time.perf_counter() - start
            ttfts.append(ttft)
            gaps.extend(g)
            rates.append(max_tokens / total_s)
    return ttfts, gaps, rates


def _summary(ttfts: list, gaps: list, rates: list) -> dict:
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
        "itl_p99_ms": 1000 * percentile(gaps, 99) if gaps else None,
        "tokens_per_s_median": statistics.median(rates),
        "requests": len(ttfts),
    }


def guard_cpu_cost_us(patterns_file: Path, num_tokens: int = 2000) -> float:
    """Microseconds of guard work per token (check + hold-back bookkeeping), in-process."""
    guard = PatternGuard.from_file(patterns_file)
    pieces = [f"tok{i % 97} " for i in range(num_tokens)]

    async def run() -> float:
        choice = GuardedChoice(GuardConfig(guard, hold_back_tokens=4))
        start = time.perf_counter()
        for i, piece in enumerate(pieces):
            await choice.push(piece, [], 1, i == num_tokens - 1)
        return time.perf_counter() - start

    return 1e6 * asyncio.run(run()) / num_tokens


def metrics_cpu_cost_us(num: int = 20000) -> dict:
    """Microseconds per engine step (on the engine thread) and per streamed token (event loop)."""
    metrics = ServerMetrics()
    stats = StepStats(
        step_id=1,
        num_seqs=4,
        num_tokens=4,
        num_running=4,
        num_waiting=0,
        schedule_time_s=1e-4,
        execute_time_s=2e-3,
        sample_time_s=1e-4,
        update_time_s=5e-5,
    )
    start = time.perf_counter()
    for _ in range(num):
        metrics.on_step(stats)
    per_step_us = 1e6 * (time.perf_counter() - start) / num
    timer = metrics.request_timer(ServiceTier.PRIORITY, "", arrival_s=0.0)
    start = time.perf_counter()
    for i in range(num):
        timer.output(0, 1, 0.0, now_s=0.001 * (i + 1))
    return {"per_step_us": per_step_us, "per_token_us": 1e6 * (time.perf_counter() - start) / num}


def main(args) -> int:
    patterns = Path(args.guard_patterns or EXAMPLE_PATTERNS)
    hold_back = args.hold_back_tokens
    configs = _configs(hold_back, patterns)
    raw: dict[str, tuple[list, list, list]] = {name: ([], [], []) for name in configs}
    for round_index in range(args.rounds):
        order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
        for name in order:
            srv = ServerProcess(
                *configs[name],
                "--priority-ttft-ms",
                "60000",
                model=args.model,
                num_slots=args.num_slots,
            )
            try:
                for into, values in zip(
                    raw[name], asyncio.run(_probe(srv.url, args.probes, args.new_tokens))
                ):
                    into.extend(values)
            finally:
                srv.stop()
    results = {name: _summary(*values) for name, values in raw.items()}
    cpu_us = guard_cpu_cost_us(patterns)
    metrics_us = metrics_cpu_cost_us()
    base = results["none"]
    lines = [
        "| config | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tok/s | tok/s vs none |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
            f"{r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | "
            f"{r['tokens_per_s_median']:.1f} | "
            f"{r['tokens_per_s_median'] / base['tokens_per_s_median']:.3f} |"
        )
    lines.append(f"\nguard CPU per token (in-process, {patterns.name}): {cpu_us:.1f} us")
    lines.append(
        f"metrics CPU: {metrics_us['per_step_us']:.1f} us per engine step, "
        f"{metrics_us['per_token_us']:.1f} us per streamed token"
    )
    report = {
        "suite": "guard",
        "model": str(args.model),
        "patterns": str(patterns),
        "hold_back_tokens": hold_back,
        "rounds": args.rounds,
        "probes": args.probes,
        "new_tokens": args.new_tokens,
        "results": results,
        "guard_cpu_us_per_token": cpu_us,
        "metrics_cpu_us": metrics_us,
    }
    return write_report(report, args.out, "\n".join(lines))


if __name__ == "__main__":
    print(json.dumps({"guard_cpu_us_per_token": guard_cpu_cost_us(EXAMPLE_PATTERNS)}))


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench guard --help`)."""
    add_model(p)
    add_server_slots(p)
    p.add_argument("--probes", type=int, default=8, help="priority requests per round (default 8)")
    add_new_tokens(p, "tokens generated per probe")
    add_rounds(p, 3)
    p.add_argument(
        "--guard-patterns",
        default=None,
        metavar="FILE",
        help="patterns file (default deploy/guard-patterns.example.json)",
    )
    p.add_argument(
        "--hold-back-tokens",
        type=int,
        default=4,
        help="the server's --guard-hold-back-tokens (default 4)",
    )
    add_out(p, "runs/bench_guard.json")
