"""Does the Ultrafast lane hold under load? And what does the HTTP path cost per token?

1. Priority streams on an idle server, then the same priority streams while default-tier
   streams keep every other slot busy: p50 TTFT and p99 inter-token latency, loaded / idle.
2. Batch-1 tokens/s streamed over HTTP vs the in-process engine (bench/overhead.py).
Everything runs on this machine against 127.0.0.1 only, bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from ultrafast.progress import Progress
from ultrafast_harness.bench.overhead import markdown as overhead_markdown
from ultrafast_harness.bench.overhead import run_overhead_bench
from ultrafast_harness.bench.report import write_report
from ultrafast_harness.bench.server_process import ServerProcess, serve_default_threads
from ultrafast_harness.bench.suite_args import (
    add_model,
    add_out,
    add_rounds,
    add_server_slots,
    add_threads,
)

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def stream_once(client: httpx.AsyncClient, body: dict) -> tuple[float, list[float]]:
    """Time to first token and the gaps between token events of one streamed completion."""
    start = time.perf_counter()
    stamps = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text":' in line:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps


async def probe(client, tier: str, count: int, max_tokens: int) -> dict:
    ttfts, gaps = [], []
    for i in range(count):
        ttft, g = await stream_once(
            client,
            {
                "prompt": PROMPT + f"# probe {i}\n",
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
                "service_tier": tier,
            },
        )
        ttfts.append(ttft)
        gaps.extend(g)
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "requests": count,
        "tokens": count * max_tokens,
    }


async def load(client, num_streams: int, stop: asyncio.Event, done: list[int]) -> None:
    async def one(k: int) -> None:
        while not stop.is_set():
            _, gaps = await stream_once(
                client,
                {
                    "prompt": PROMPT + f"# load {k}\n",
                    "max_tokens": 200,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                    "service_tier": "default",
                },
            )
            done.append(len(gaps) + 1)

    await asyncio.gather(*(one(k) for k in range(num_streams)))


async def wait_running(client, n: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await client.get("/ready")).json()["running"] >= n:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"load never reached {n} running streams")


async def tier_scenario(url: str, num_slots: int, probes: int, max_tokens: int) -> dict:
    progress = Progress("bench tiers", total=4, unit="phases")
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await probe(client, "priority", 2, 8)  # warm-up: the cost model learns the idle step
        progress.update(phase="warm-up")
        idle = await probe(client, "priority", probes, max_tokens)
        progress.update(phase="idle")
        stop, done = asyncio.Event(), list[int]()
        load_task = asyncio.create_task(load(client, num_slots - 1, stop, done))
        await wait_running(client, num_slots - 1)
        loaded = await probe(client, "priority", probes, max_tokens)
        progress.update(phase="loaded")
        stop.set()
        await load_task
        stall = await long_prompt_stall(client, idle["itl_p99_ms"])
        progress.update(phase="long prompt")
    progress.close()
    return {
        "idle": idle,
        "loaded": loaded,
        "background_streams": num_slots - 1,
        "long_prompt": stall,
        "ttft_p50_ratio": loaded["ttft_p50_ms"] / idle["ttft_p50_ms"],
        "itl_p99_ratio": loaded["itl_p99_ms"] / idle["itl_p99_ms"],
    }


async def long_prompt_stall(client, idle_itl_p99_ms: float) -> dict:
    """A ~380-token default-tier prompt lands while a priority stream decodes: how long is
    the priority stream's worst gap? (Prefill is chunked to the priority step budget.)"""
    long_prompt = "value = compute(alpha, beta)\n" * 32  # ~380 tokens

    async def intruder() -> None:
        await asyncio.sleep(0.05)
        await client.post(
            "/v1/completions",
            json={"prompt": long_prompt, "max_tokens": 1, "service_tier": "default"},
        )

    task = asyncio.create_task(intruder())
    _, gaps = await stream_once(
        client,
        {
            "prompt": PROMPT,
            "max_tokens": 96,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "service_tier": "priority",
        },
    )
    await task
    return {
        "max_gap_ms": 1000 * max(gaps),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "idle_itl_p99_ms": idle_itl_p99_ms,
    }


def run_tier_bench(
    model: str,
    num_slots: int = 4,
    probes: int = 8,
    max_tokens: int = 64,
    rounds: int = 10,
    threads: int | None = None,
) -> dict:
    threads = threads or serve_default_threads()
    streaming = run_overhead_bench(model, threads, num_slots=num_slots, rounds=rounds)
    # speculative decoding off: this measures the lane (scheduling, preemption, chunked
    # prefill); with drafts a priority event carries several tokens and event gaps stop being
    # per-token latencies (`bench decode --speculation` measures it)
    server = ServerProcess(
        "--threads", str(threads), "--speculation", "off", model=model, num_slots=num_slots
    )
    try:
        tiers = asyncio.run(tier_scenario(server.url, num_slots, probes, max_tokens))
    finally:
        server.stop()
    return {
        "model": str(model),
        "num_slots": num_slots,
        "threads": threads,
        "tiers": tiers,
        "streaming": streaming,
    }


def markdown(report: dict) -> str:
    t, s = report["tiers"], report["streaming"]
    i, lo = t["idle"], t["loaded"]
    return "\n".join(
        [
            f"priority streams ({i['requests']} x {i['tokens'] // i['requests']} tokens), idle vs "
            f"with {t['background_streams']} default-tier streams saturating the other slots",
            "",
            "| | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
            "|---|---|---|---|---|",
            f"| idle | {i['ttft_p50_ms']:.1f} | {i['ttft_p99_ms']:.1f} | {i['itl_p50_ms']:.2f} | "
            f"{i['itl_p99_ms']:.2f} |",
            f"| loaded | {lo['ttft_p50_ms']:.1f} | {lo['ttft_p99_ms']:.1f} | "
            f"{lo['itl_p50_ms']:.2f} | {lo['itl_p99_ms']:.2f} |",
            f"| loaded / idle | {t['ttft_p50_ratio']:.2f}x | | | {t['itl_p99_ratio']:.2f}x |",
            "",
            f"a ~380-token default prompt arriving mid-stream: priority worst gap "
            f"{t['long_prompt']['max_gap_ms']:.1f} ms, p99 {t['long_prompt']['itl_p99_ms']:.2f} ms "
            f"(idle p99 {t['long_prompt']['idle_itl_p99_ms']:.2f} ms)",
            "",
            overhead_markdown(s),
        ]
    )


def main(args) -> int:
    report = run_tier_bench(
        args.model,
        num_slots=args.num_slots,
        probes=args.probes,
        rounds=args.rounds,
        threads=args.threads,
    )
    return write_report(report, args.out, markdown(report))


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench tiers --help`)."""
    add_model(p)
    add_server_slots(p)
    p.add_argument("--probes", type=int, default=8, help="priority requests per phase (default 8)")
    add_rounds(p, 10, "streaming-overhead rounds")
    add_threads(p, "the server's kernel threads (default: the serve default)")
    add_out(p, "runs/bench_tiers.json")
