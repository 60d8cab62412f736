"""Scenarios whose state lives outside the engine (docs/RELIABILITY.md 7b/7c): sessions on a real
redis-server (L5), tenants with quotas (L6) and Idempotency-Key retries (F16), and the session
helpers the store's fault scenarios (F6-F9, scenarios_redis.py) share.

Each scenario starts its own redis-server (AOF `always`, a temporary directory, a free loopback
port) and its own server on the fake executor (what is checked here is the store and the
admission, not the text), and stops both at the end. "Exactly once" is checked on the stored
conversation items.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from ultrafast.server.tenants import hash_key
from ultrafast_harness.bench.redis_server import RedisServer
from ultrafast_harness.bench.sessions import ConversationRun, check_exactly_once, run_conversations
from ultrafast_harness.loadtest.client import CallRecord, metric_total, plain_call, stream_call
from ultrafast_harness.loadtest.harness import Context, Result, ServerSpec
from ultrafast_harness.loadtest.invariants import check_rejection, check_terminal, percentiles_ms
from ultrafast_harness.loadtest.scenarios_load import (
    LIMITS,
    checked_stream,
    client_for,
    finish_checks,
)

CHAT = "/v1/chat/completions"
STORE_TIMEOUT_S = 2.0  # the store's per-call timeout (StoreConfig.timeout_s)


def session_spec(store_url: str, step_ms: float = 5.0, *extra: str) -> ServerSpec:
    return ServerSpec(
        num_slots=8,
        fake_step_ms=step_ms,
        extra=("--session-store", store_url, "--default-queue", "64", *extra),
    )


async def start_server(ctx: Context, spec: ServerSpec):
    """A server of the scenario's own, started off the event loop (a proxy may be serving)."""
    return await asyncio.to_thread(ctx.server, spec, True)


def turn_body(session_id: str, k: int, max_tokens: int = 8) -> dict:
    return {
        "messages": [{"role": "user", "content": f"# {session_id} turn {k}\ndef f{k}(x):"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "session_id": session_id,
    }


def key_of(session_id: str, k: int) -> dict:
    return {"Idempotency-Key": f"{session_id}-t{k}"}


async def session_turn(
    client, session_id: str, k: int, max_tokens: int = 8, stream: bool = False, tag: str = "session"
) -> CallRecord:
    body = turn_body(session_id, k, max_tokens)
    if stream:
        return await stream_call(client, body, tag, path=CHAT, headers=key_of(session_id, k))
    return await plain_call(client, body, tag, path=CHAT, headers=key_of(session_id, k))


async def exactly_once(url: str, sent: dict[str, list[int]], result: Result) -> dict:
    """Each session holds exactly the sent turns (user + assistant), once each, in order."""
    run = ConversationRun(list(sent))
    run.sent = {
        sid: [turn_body(sid, k)["messages"][0]["content"] for k in ks] for sid, ks in sent.items()
    }
    check = await asyncio.to_thread(check_exactly_once, url, run)
    expected = 2 * sum(len(ks) for ks in sent.values())
    if check["num_turns_found"] != expected:
        result.fail([f"{check['num_turns_found']} turns stored, want {expected}"])
    result.fail(check["problems"])
    return {"expected_turns": expected, "found_turns": check["num_turns_found"]}


def ok_stream(rec: CallRecord, max_tokens: int) -> list[str]:
    """A streamed session turn read to its end: one terminal event, all tokens, no error."""
    if rec.status != 200:
        return [f"{rec.tag} call: status {rec.status} {rec.error}"]
    problems = check_terminal(rec)
    if rec.num_error_events:
        problems.append(f"{rec.tag} call: error event {rec.error}")
    got = (rec.usage or {}).get("completion_tokens")
    if got != max_tokens:
        problems.append(f"{rec.tag} call: {got} completion tokens, want {max_tokens}")
    return problems


async def until_ok(client, session_id: str, k: int, within_s: float = 15.0) -> CallRecord:
    """Retry one turn (same Idempotency-Key) until it is accepted, as a client would."""
    deadline = time.monotonic() + within_s
    while True:
        rec = await session_turn(client, session_id, k, tag="after-outage")
        if rec.status == 200 or time.monotonic() > deadline:
            return rec
        await asyncio.sleep(0.2)


# ---- L5: sessions x turns on real Redis with one restart --------------------------------------


async def l5_sessions(ctx: Context, result: Result) -> None:
    num_sessions, num_turns, concurrency = ctx.size(200, 8), ctx.size(20, 4), ctx.size(16, 4)
    redis = RedisServer()
    srv = await start_server(ctx, session_spec(redis.url))
    try:
        run = await asyncio.to_thread(
            run_conversations,
            srv.url,
            num_sessions,
            num_turns,
            concurrency,
            8,
            restart=redis.restart,
            restart_after_turns=num_sessions * num_turns // 2,
            session_prefix="l5",
        )
        check = await asyncio.to_thread(check_exactly_once, srv.url, run)
        expected = 2 * num_sessions * num_turns
        result.num_requests += num_sessions * num_turns + run.num_retries
        if check["num_turns_found"] != expected:
            result.fail([f"{check['num_turns_found']} turns stored, want {expected}"])
        result.fail(check["problems"])
        if run.num_restarts != 1:
            result.fail(["Redis was not restarted during the run"])
        result.metrics.update(
            sessions=num_sessions,
            turns=num_turns,
            concurrency=concurrency,
            expected_turns=expected,
            found_turns=check["num_turns_found"],
            retried_calls=run.num_retries,
            refused_503=run.num_503,
            turns_done_when_redis_was_back=run.num_turns_before_restart_end,
            elapsed_s=round(run.elapsed_s, 1),
        )
        async with client_for(srv.url) as client:
            await finish_checks(ctx, client, result)
    finally:
        srv.stop()
        redis.close()


# ---- L6: one tenant floods, another stays under quota -----------------------------------------

TENANT_KEYS = {name: f"uf-loadtest-{name}-key" for name in ("flood", "calm", "edge", "ops")}


def write_keys_file(directory: Path) -> Path:
    """flood and calm: 10 requests/s each; edge: a bucket of 5 that barely refills."""

    def tenant(name, **extra):
        return {"name": name, "keys": [{"sha256": hash_key(TENANT_KEYS[name])}], **extra}

    path = directory / "api-keys.json"
    path.write_text(
        json.dumps(
            {
                "tenants": [
                    tenant("flood", requests_per_s=10, burst_s=1),
                    tenant("calm", requests_per_s=10, burst_s=1),
                    tenant("edge", requests_per_s=0.002, burst_s=2500),
                    tenant("ops", scopes=["admin"], tiers=["priority", "default", "flex"]),
                ]
            }
        )
    )
    return path


def tenant_client(url: str, name: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(120, connect=30),
        limits=LIMITS,
        headers={"Authorization": f"Bearer {TENANT_KEYS[name]}"},
    )


async def paced(rate_per_s: float, duration_s: float, call) -> list:
    """Start `call()` at a steady rate for `duration_s`; all their results."""
    tasks, started = [], time.monotonic()
    while time.monotonic() - started < duration_s:
        tasks.append(asyncio.create_task(call()))
        await asyncio.sleep(max(0.0, started + len(tasks) / rate_per_s - time.monotonic()))
    return await asyncio.gather(*tasks)


async def l6_tenants(ctx: Context, result: Result) -> None:
    solo_s, flood_s = ctx.size(20.0, 3.0), ctx.size(40.0, 5.0)
    with tempfile.TemporaryDirectory(prefix="ultrafast-l6-") as tmp:
        keys = write_keys_file(Path(tmp))
        srv = await start_server(
            ctx, ServerSpec(num_slots=8, fake_step_ms=10.0, extra=("--api-keys", str(keys)))
        )
    try:
        async with (
            tenant_client(srv.url, "flood") as flood,
            tenant_client(srv.url, "calm") as calm,
            tenant_client(srv.url, "edge") as edge,
            tenant_client(srv.url, "ops") as ops,
        ):

            def calm_call():  # 50% of calm's quota, streamed and checked token for token
                return checked_stream(ctx, calm, result, 16, "default", "calm")

            def flood_call():  # 10x flood's quota
                return plain_call(
                    flood,
                    {"prompt": ctx.fake_prompt(), "max_tokens": 4, "ignore_eos": True},
                    "flood",
                )

            solo = await paced(5, solo_s, calm_call)
            flood_started = time.monotonic()
            flooded, calm_loaded = await asyncio.gather(
                paced(100, flood_s, flood_call), paced(5, flood_s, calm_call)
            )
            span_s = time.monotonic() - flood_started  # every flood call arrived within it
            result.num_requests += len(flooded)
            admitted = [r for r in flooded if r.status == 200]
            for rec in flooded:
                if rec.status != 200:
                    result.fail(check_rejection(rec, 429, "rate_limit_exceeded"))
            most = 10 * span_s + 10 + 1  # refill over the span + one full bucket (+ rounding)
            if not 0.5 * (10 * flood_s + 10) <= len(admitted) <= most:
                result.fail(
                    [
                        f"flood tenant: {len(admitted)} of {len(flooded)} admitted in "
                        f"{span_s:.1f} s; its quota allows at most {most:.0f}"
                    ]
                )
            solo_ttft = percentiles_ms([r.ttft_s for r in solo if r.ttft_s])
            loaded_ttft = percentiles_ms([r.ttft_s for r in calm_loaded if r.ttft_s])
            result.metrics.update(
                flood_sent=len(flooded),
                flood_admitted=len(admitted),
                calm_calls=len(solo) + len(calm_loaded),
                calm_ttft_solo=solo_ttft,
                calm_ttft_during_flood=loaded_ttft,
                calm_ttft_p99_ratio=round(loaded_ttft["p99_ms"] / solo_ttft["p99_ms"], 3),
            )
            await _quota_edge(ctx, edge, result)
            await finish_checks(ctx, ops, result)
    finally:
        srv.stop()


async def _quota_edge(ctx: Context, edge, result: Result) -> None:
    """A bucket of 5: 4 calls leave one request; 100 in parallel then admit exactly 1."""

    def call():
        return plain_call(edge, {"prompt": ctx.fake_prompt(), "max_tokens": 1}, "edge")

    for _ in range(4):
        rec = await call()
        if rec.status != 200:
            result.fail([f"edge tenant: call under quota answered {rec.status}"])
    burst = await asyncio.gather(*(call() for _ in range(100)))
    result.num_requests += 104
    num_ok = sum(r.status == 200 for r in burst)
    result.metrics["edge_admitted_of_100_at_quota_minus_1"] = num_ok
    if num_ok != 1:
        result.fail([f"edge tenant at quota-1: {num_ok} of 100 parallel calls admitted, want 1"])
    for rec in burst:
        if rec.status != 200:
            result.fail(check_rejection(rec, 429, "rate_limit_exceeded"))


# ---- F16: a retry with the same Idempotency-Key -----------------------------------------------


async def f16_idempotent_retry(ctx: Context, result: Result) -> None:
    redis = RedisServer()
    srv = await start_server(ctx, session_spec(redis.url, 20.0))
    try:
        async with client_for(srv.url) as client:
            # 1. the client gives up after 0.3 s (the server sees it leave) and retries
            try:
                await client.post(
                    CHAT, json=turn_body("f16-a", 0, 60), headers=key_of("f16-a", 0), timeout=0.3
                )
                result.fail(["the first call was meant to time out on the client"])
            except httpx.TimeoutException:
                pass
            retry = await _retry_past_409(client, "f16-a", 0)
            tokens_before = await metric_total(client, "ultrafast_generation_tokens")
            again = await plain_call(
                client, turn_body("f16-a", 0, 60), "replay", CHAT, key_of("f16-a", 0)
            )
            tokens_after = await metric_total(client, "ultrafast_generation_tokens")
            for rec in (retry, again):
                if rec.status != 200 or rec.headers.get("idempotent-replayed") != "true":
                    result.fail([f"{rec.tag}: status {rec.status}, not the stored answer"])
            if again.text != retry.text:
                result.fail(["two retries of one key got different answers"])
            if tokens_after != tokens_before:
                result.fail([f"a replay generated {tokens_after - tokens_before} tokens"])
            # 2. the same key again while the first call still streams: 409, then its answer
            first = asyncio.create_task(session_turn(client, "f16-b", 0, 60, True, "first"))
            await asyncio.sleep(0.4)
            busy = await session_turn(client, "f16-b", 0, tag="duplicate")
            result.fail(check_rejection(busy, 409, "request_in_progress"))
            first_rec = await first
            result.fail(ok_stream(first_rec, 60))
            replay = await session_turn(client, "f16-b", 0, 60, True, "replay-stream")
            if replay.text != first_rec.text or replay.num_done != 1:
                result.fail(["the replayed stream differs from the first call's answer"])
            result.num_requests += 6
            result.metrics["stored"] = await exactly_once(
                srv.url, {"f16-a": [0], "f16-b": [0]}, result
            )
            await finish_checks(ctx, client, result)
    finally:
        srv.stop()
        redis.close()


async def _retry_past_409(client, session_id: str, k: int, within_s: float = 10.0):
    """Retry while the abandoned first attempt is still being wound down (409)."""
    deadline = time.monotonic() + within_s
    while True:
        rec = await session_turn(client, session_id, k, 60, tag="retry")
        if rec.status != 409 or time.monotonic() > deadline:
            return rec
        await asyncio.sleep(0.1)
