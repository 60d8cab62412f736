"""Load scenarios L1-L7 of docs/RELIABILITY.md 7c, and the irregular burst (many 1-token calls
with an occasional 64-token call) with and without the request shaper.

Sizes: the full tier uses the spec's numbers (32 streams, 256 tokens, 256-call bursts); the CI
tier shrinks counts so the whole CI subset runs in about a minute on two cores. Every scenario
ends with the "nothing lost" checks (invariants.py).
"""

from __future__ import annotations

import asyncio
import random

import httpx

from ultrafast_harness.loadtest.client import CallRecord, stream_call
from ultrafast_harness.loadtest.harness import Context, Result, ServerSpec
from ultrafast_harness.loadtest.invariants import (
    MemoryWatch,
    check_content,
    check_rejection,
    check_terminal,
    cpu_s,
    percentiles_ms,
    wait_at_rest,
)

LIMITS = httpx.Limits(max_connections=2000, max_keepalive_connections=64)


def client_for(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=30), limits=LIMITS)


def fake_body(ctx: Context, max_tokens: int, tier: str = "default") -> tuple[dict, str]:
    prompt = ctx.fake_prompt()
    return (
        {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "service_tier": tier},
        ctx.fake_expected(prompt, max_tokens),
    )


async def checked_stream(
    ctx,
    client,
    result: Result,
    max_tokens: int,
    tier: str,
    tag: str,
    cancel_after: int | None = None,
):
    body, expected = fake_body(ctx, max_tokens, tier)
    rec = await stream_call(client, body, tag, cancel_after_events=cancel_after)
    result.num_requests += 1
    if rec.status != 200:
        result.fail([f"{tag} call: status {rec.status} {rec.error}"])
    elif rec.cancelled:
        if not expected.startswith(rec.text):  # what arrived before leaving is still exact
            result.fail(
                [f"{tag} call: the text before the cancel is not a prefix of the expected output"]
            )
    else:
        result.fail(check_terminal(rec) + check_content(rec, expected, max_tokens))
    return rec


async def finish_checks(
    ctx, client, result: Result, mem: MemoryWatch | None = None, settle_s: float = 10.0
) -> None:
    problems, state = await wait_at_rest(client, settle_s)
    result.fail(problems)
    result.metrics["at_rest"] = state
    if mem is not None:
        result.fail(mem.end())
        result.metrics.update(mem.summary())


async def l1_steady(ctx: Context, result: Result) -> None:
    """Steady streams, back to back: exact content, latency, CPU and memory after warm-up."""
    streams, tokens = ctx.size(32, 6), ctx.size(256, 24)
    srv = ctx.server(ServerSpec(num_slots=streams, fake_step_ms=20.0))
    budget = ctx.budget(max_requests=ctx.size(10_000, 3 * streams), duration_s=180)
    mem = MemoryWatch(srv.pid, 20.0)
    records: list[CallRecord] = []
    async with client_for(srv.url) as client:
        cpu0 = cpu_s(srv.pid) if srv.pid else None
        progress = ctx.progress("L1 steady", budget.max_requests)

        async def worker() -> None:
            while budget.more():
                records.append(
                    await checked_stream(ctx, client, result, tokens, "default", "steady")
                )
                progress.update(errors=len(result.violations))
                if len(records) == streams:
                    mem.warm()  # after one full round: allocator pools and caches are warm

        await asyncio.gather(*(worker() for _ in range(streams)))
        progress.close()
        if cpu0 is not None:
            result.metrics["server_cpu_cores"] = round(
                (cpu_s(srv.pid) - cpu0) / budget.elapsed_s, 2
            )
        await finish_checks(ctx, client, result, mem)
    result.metrics["ttft"] = percentiles_ms([r.ttft_s for r in records if r.ttft_s])
    result.metrics["itl"] = percentiles_ms([g for r in records for g in r.itl_s])
    result.metrics["streams"], result.metrics["tokens_per_stream"] = streams, tokens


async def overload_burst(
    ctx: Context,
    result: Result,
    num_running: int,
    num_queue: int,
    burst: int,
    rounds: int,
    tokens: int,
    label: str,
) -> None:
    """`burst` simultaneous calls at a server that admits num_running + num_queue."""
    capacity = num_running + num_queue
    srv = ctx.server(
        ServerSpec(
            num_slots=num_running, fake_step_ms=20.0, extra=("--default-queue", str(capacity))
        )
    )
    rejections, admitted_counts = [], []
    async with client_for(srv.url) as client:
        for round_index in range(rounds):
            budget = ctx.budget(max_requests=burst)
            calls = []
            while budget.more():
                calls.append(checked_or_rejected(ctx, client, result, tokens))
            recs = await asyncio.gather(*calls)
            ok = [r for r in recs if r.status == 200]
            rejected = [r for r in recs if r.status != 200]
            admitted_counts.append(len(ok))
            rejections += [r.latency_s for r in rejected]
            for r in rejected:
                result.fail(check_rejection(r, 503, "queue_full"))
            first_done = min((r.started_s + r.latency_s for r in ok), default=0)
            last_reject = max((r.started_s + r.latency_s for r in rejected), default=0)
            if len(recs) == burst and last_reject < first_done and len(ok) != min(capacity, burst):
                result.fail(
                    [
                        f"{label} round {round_index}: {len(ok)} admitted, want exactly "
                        f"{min(capacity, burst)}"
                    ]
                )
            await finish_checks(ctx, client, result)
    result.metrics.update(
        {
            "capacity": capacity,
            "burst": burst,
            "admitted": admitted_counts,
            "rejection_latency": percentiles_ms(rejections),
        }
    )


async def checked_or_rejected(ctx, client, result: Result, tokens: int):
    body, expected = fake_body(ctx, tokens)
    rec = await stream_call(client, body, "burst")
    result.num_requests += 1
    if rec.status == 200:
        result.fail(check_terminal(rec) + check_content(rec, expected, tokens))
    return rec


async def l2_overload(ctx: Context, result: Result) -> None:
    await overload_burst(
        ctx,
        result,
        ctx.size(32, 4),
        ctx.size(64, 8),
        ctx.size(256, 36),
        ctx.size(3, 1),
        ctx.size(256, 40),
        "L2",
    )


async def l3_churn(ctx: Context, result: Result) -> None:
    """Streams of which 30% leave at a random token: everything freed, the rest exact."""
    streams, tokens = ctx.size(32, 6), ctx.size(256, 32)
    srv = ctx.server(ServerSpec(num_slots=streams, fake_step_ms=20.0))
    budget = ctx.budget(max_requests=ctx.size(10_000, 3 * streams), duration_s=180)
    rng = random.Random(1234)
    cancelled = []
    mem = MemoryWatch(srv.pid, 20.0)
    async with client_for(srv.url) as client:
        progress = ctx.progress("L3 churn", budget.max_requests)

        async def worker() -> None:
            while budget.more():
                cut = rng.randint(1, min(200, tokens - 1)) if rng.random() < 0.3 else None
                rec = await checked_stream(ctx, client, result, tokens, "default", "churn", cut)
                cancelled.append(rec.cancelled)
                progress.update(cancelled=sum(cancelled))
                if len(cancelled) == streams:
                    mem.warm()

        await asyncio.gather(*(worker() for _ in range(streams)))
        progress.close()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await finish_checks(ctx, client, result, mem)
        result.metrics["settle_after_last_call_ms"] = round(1000 * (loop.time() - t0), 1)
    result.metrics["cancelled"] = sum(cancelled)


async def l4_priority_lane(ctx: Context, result: Result) -> None:
    """Normal streams fill every slot; a priority call arrives every interval (preempting)."""
    streams, tokens = ctx.size(32, 4), ctx.size(256, 64)
    interval_s, num_probes = ctx.size(2.0, 0.4), ctx.size(60, 4)
    srv = ctx.server(ServerSpec(num_slots=streams, fake_step_ms=20.0))
    probes, normals = [], []
    budget = ctx.budget(max_requests=ctx.size(10_000, 3 * streams + num_probes), duration_s=120)
    stop = asyncio.Event()
    mem = MemoryWatch(srv.pid, 20.0)
    async with client_for(srv.url) as client:

        async def normal() -> None:
            while not stop.is_set() and budget.more():
                normals.append(
                    await checked_stream(ctx, client, result, tokens, "default", "normal")
                )
                if len(normals) == streams:
                    mem.warm()

        tasks = [asyncio.create_task(normal()) for _ in range(streams)]
        await asyncio.sleep(interval_s)
        for _ in range(num_probes):
            if not budget.more():
                break
            probes.append(await checked_stream(ctx, client, result, 8, "priority", "priority"))
            await asyncio.sleep(interval_s)
        stop.set()
        await asyncio.gather(*tasks)
        await finish_checks(ctx, client, result, mem)
    result.metrics["priority_ttft"] = percentiles_ms([p.ttft_s for p in probes if p.ttft_s])
    result.metrics["normal_itl"] = percentiles_ms([g for r in normals for g in r.itl_s])
    result.metrics["normal_streams"] = streams


def demo_spec(shaper_window_ms: str) -> ServerSpec:
    """The demo model server of L7 and the burst (same spec, so one server serves both)."""
    return ServerSpec(  # KV slots and queue limits as `serve` sizes them (issue 18)
        executor="demo",
        num_slots=0,
        max_model_len=512,
        extra=("--shaper-window-ms", shaper_window_ms),
    )


DEMO_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args():\n    parser = ",
]


async def l7_demo_model(ctx: Context, result: Result) -> None:
    """The real demo model: concurrent temperature-0 streams equal the non-streamed text."""
    streams, tokens = 4, ctx.size(64, 16)
    srv = ctx.server(demo_spec(shaper_window_ms="2"))
    budget = ctx.budget(max_requests=ctx.size(10_000, 8), duration_s=120)
    mem = MemoryWatch(srv.pid, 20.0)  # MiB of growth: stricter than the reliability cases' 50
    records: list[CallRecord] = []
    async with client_for(srv.url) as client:
        baselines = {p: await ctx.demo_baseline(client, p, tokens) for p in DEMO_PROMPTS}
        progress = ctx.progress("L7 demo model", budget.max_requests)

        async def worker(k: int) -> None:
            while budget.more():
                prompt = DEMO_PROMPTS[(k + len(records)) % len(DEMO_PROMPTS)]
                rec = await stream_call(
                    client,
                    {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True},
                    "demo",
                )
                result.num_requests += 1
                records.append(rec)
                result.fail(check_terminal(rec) + check_content(rec, baselines[prompt], tokens))
                progress.update()
                if len(records) == streams:
                    mem.warm()

        await asyncio.gather(*(worker(k) for k in range(streams)))
        progress.close()
        await finish_checks(ctx, client, result, mem)
    result.metrics["ttft"] = percentiles_ms([r.ttft_s for r in records if r.ttft_s])
    result.metrics["itl"] = percentiles_ms([g for r in records for g in r.itl_s])


async def irregular_burst(ctx: Context, result: Result) -> None:
    """The published stress pattern: a burst of 1-token calls, every 16th one asks 64 tokens,
    on the demo model, with the shaper on (its default window) and off. p50/p99 per group."""
    num_calls, rounds = ctx.size(192, 24), ctx.size(3, 1)
    for label, window_ms in (("shaper_on", "2"), ("shaper_off", "0")):
        srv = ctx.server(demo_spec(window_ms))
        groups: dict[str, list] = {"short": [], "long": []}
        mem = MemoryWatch(srv.pid, 20.0)
        async with client_for(srv.url) as client:
            baselines = {
                (p, n): await ctx.demo_baseline(client, p, n) for p in DEMO_PROMPTS for n in (1, 64)
            }
            mem.warm()  # after the baselines: the model has run every prompt once
            for _ in range(rounds):
                budget = ctx.budget(max_requests=num_calls)
                calls: list[asyncio.Task[CallRecord]] = []
                while budget.more():
                    i = len(calls)
                    n = 64 if i % 16 == 0 else 1
                    prompt = DEMO_PROMPTS[i % len(DEMO_PROMPTS)]
                    calls.append(
                        asyncio.create_task(
                            stream_call(
                                client,
                                {
                                    "prompt": prompt,
                                    "max_tokens": n,
                                    "temperature": 0,
                                    "ignore_eos": True,
                                },
                                "long" if n == 64 else "short",
                            )
                        )
                    )
                    await asyncio.sleep(0.002)  # interleaved arrivals, not one syscall burst
                for rec in await asyncio.gather(*calls):
                    result.num_requests += 1
                    groups[rec.tag].append(rec)
                    n = rec.body["max_tokens"]
                    result.fail(
                        check_terminal(rec)
                        + check_content(rec, baselines[(rec.body["prompt"], n)], n)
                    )
            await finish_checks(ctx, client, result, mem)
        result.metrics[label + "_memory"] = mem.summary()
        result.metrics[label] = {
            tag: {
                "latency": percentiles_ms([r.latency_s for r in recs]),
                "ttft": percentiles_ms([r.ttft_s for r in recs if r.ttft_s]),
            }
            for tag, recs in groups.items()
        }


async def l8_many_streams(ctx: Context, result: Result) -> None:
    """One client opens hundreds of streams at once against the default capacity (auto KV
    slots, auto queue): every call completes exactly, or is refused with 429 because its
    predicted wait exceeds the tier's target (Retry-After set); never a 503 while memory is
    free, never a lost or duplicated token, and every slot is free at the end."""
    num_streams, tokens = ctx.size(500, 120), ctx.size(16, 8)
    srv = ctx.server(ServerSpec(num_slots=0, fake_step_ms=20.0))
    mem = MemoryWatch(srv.pid, 50.0)
    async with client_for(srv.url) as client:
        mem.warm()
        recs = await asyncio.gather(
            *(checked_or_rejected(ctx, client, result, tokens) for _ in range(num_streams))
        )
        refused = [r for r in recs if r.status != 200]
        for rec in refused:
            result.fail(check_rejection(rec, 429, "wait_over_target"))
        await finish_checks(ctx, client, result, mem)
    result.metrics["streams"] = num_streams
    result.metrics["refused"] = len(refused)
    result.metrics["ttft"] = percentiles_ms([r.ttft_s for r in recs if r.ttft_s])
