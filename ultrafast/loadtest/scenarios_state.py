"""Scenarios whose state lives outside the engine (RELIABILITY 7b/7c): sessions on a real
redis-server (L5, F6-F9), tenants with quotas (L6) and Idempotency-Key retries (F16).

Each scenario starts its own redis-server (AOF `always`, a temporary directory, a free loopback
port) and its own server on the fake executor (what is checked here is the store and the
admission, not the text), and stops both at the end. F7 and F9 put a TcpProxy between the server
and Redis to cut or slow the link. "Exactly once" is checked on the stored conversation items.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from ultrafast.bench.redis_server import RedisServer
from ultrafast.bench.sessions import ConversationRun, check_exactly_once, run_conversations
from ultrafast.loadtest.client import CallRecord, metric_total, plain_call, stream_call
from ultrafast.loadtest.harness import Context, Result, ServerSpec
from ultrafast.loadtest.invariants import check_rejection, check_terminal, percentiles_ms
from ultrafast.loadtest.scenarios_load import LIMITS, checked_stream, client_for, finish_checks
from ultrafast.loadtest.tcp_proxy import TcpProxy
from ultrafast.server.tenants import hash_key

CHAT = "/v1/chat/completions"
STORE_TIMEOUT_S = 2.0  # the store's per-call timeout (StoreConfig.timeout_s)


def session_spec(store_url: str, step_ms: float = 5.0, *extra: str) -> ServerSpec:
    return ServerSpec(num_slots=8, fake_step_ms=step_ms,
                      extra=("--session-store", store_url, "--default-queue", "64", *extra))


async def start_server(ctx: Context, spec: ServerSpec):
    """A server of the scenario's own, started off the event loop (a proxy may be serving)."""
    return await asyncio.to_thread(ctx.server, spec, True)


def turn_body(session_id: str, k: int, max_tokens: int = 8) -> dict:
    return {"messages": [{"role": "user", "content": f"# {session_id} turn {k}\ndef f{k}(x):"}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "session_id": session_id}


def key_of(session_id: str, k: int) -> dict:
    return {"Idempotency-Key": f"{session_id}-t{k}"}


async def session_turn(client, session_id: str, k: int, max_tokens: int = 8,
                       stream: bool = False, tag: str = "session") -> CallRecord:
    body = turn_body(session_id, k, max_tokens)
    if stream:
        return await stream_call(client, body, tag, path=CHAT, headers=key_of(session_id, k))
    return await plain_call(client, body, tag, path=CHAT, headers=key_of(session_id, k))


async def exactly_once(url: str, sent: dict[str, list[int]], result: Result) -> dict:
    """Each session holds exactly the sent turns (user + assistant), once each, in order."""
    run = ConversationRun(list(sent))
    run.sent = {sid: [turn_body(sid, k)["messages"][0]["content"] for k in ks]
                for sid, ks in sent.items()}
    check = await asyncio.to_thread(check_exactly_once, url, run)
    expected = 2 * sum(len(ks) for ks in sent.values())
    if check["num_turns_found"] != expected:
        result.fail([f"{check['num_turns_found']} turns stored, want {expected}"])
    result.fail(check["problems"])
    return {"expected_turns": expected, "found_turns": check["num_turns_found"]}


def _ok_stream(rec: CallRecord, max_tokens: int) -> list[str]:
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


async def _until_ok(client, session_id: str, k: int, within_s: float = 15.0) -> CallRecord:
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
            run_conversations, srv.url, num_sessions, num_turns, concurrency, 8,
            restart=redis.restart, restart_after_turns=num_sessions * num_turns // 2,
            session_prefix="l5")
        check = await asyncio.to_thread(check_exactly_once, srv.url, run)
        expected = 2 * num_sessions * num_turns
        result.num_requests += num_sessions * num_turns + run.num_retries
        if check["num_turns_found"] != expected:
            result.fail([f"{check['num_turns_found']} turns stored, want {expected}"])
        result.fail(check["problems"])
        if run.num_restarts != 1:
            result.fail(["Redis was not restarted during the run"])
        result.metrics.update(sessions=num_sessions, turns=num_turns, concurrency=concurrency,
                              expected_turns=expected, found_turns=check["num_turns_found"],
                              retried_calls=run.num_retries, refused_503=run.num_503,
                              turns_done_when_redis_was_back=run.num_turns_before_restart_end,
                              elapsed_s=round(run.elapsed_s, 1))
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
    path.write_text(json.dumps({"tenants": [
        tenant("flood", requests_per_s=10, burst_s=1),
        tenant("calm", requests_per_s=10, burst_s=1),
        tenant("edge", requests_per_s=0.002, burst_s=2500),
        tenant("ops", scopes=["admin"], tiers=["priority", "default", "flex"])]}))
    return path


def tenant_client(url: str, name: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=30),
                             limits=LIMITS, headers={"Authorization": f"Bearer "
                                                                      f"{TENANT_KEYS[name]}"})


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
        srv = await start_server(ctx, ServerSpec(num_slots=8, fake_step_ms=10.0,
                                                 extra=("--api-keys", str(keys))))
    try:
        async with tenant_client(srv.url, "flood") as flood, \
                tenant_client(srv.url, "calm") as calm, \
                tenant_client(srv.url, "edge") as edge, tenant_client(srv.url, "ops") as ops:
            def calm_call():  # 50% of calm's quota, streamed and checked token for token
                return checked_stream(ctx, calm, result, 16, "default", "calm")

            def flood_call():  # 10x flood's quota
                return plain_call(flood, {"prompt": ctx.fake_prompt(), "max_tokens": 4,
                                          "ignore_eos": True}, "flood")

            solo = await paced(5, solo_s, calm_call)
            flood_started = time.monotonic()
            flooded, calm_loaded = await asyncio.gather(paced(100, flood_s, flood_call),
                                                        paced(5, flood_s, calm_call))
            span_s = time.monotonic() - flood_started  # every flood call arrived within it
            result.num_requests += len(flooded)
            admitted = [r for r in flooded if r.status == 200]
            for rec in flooded:
                if rec.status != 200:
                    result.fail(check_rejection(rec, 429, "rate_limit_exceeded"))
            most = 10 * span_s + 10 + 1  # refill over the span + one full bucket (+ rounding)
            if not 0.5 * (10 * flood_s + 10) <= len(admitted) <= most:
                result.fail([f"flood tenant: {len(admitted)} of {len(flooded)} admitted in "
                             f"{span_s:.1f} s; its quota allows at most {most:.0f}"])
            solo_ttft = percentiles_ms([r.ttft_s for r in solo if r.ttft_s])
            loaded_ttft = percentiles_ms([r.ttft_s for r in calm_loaded if r.ttft_s])
            result.metrics.update(
                flood_sent=len(flooded), flood_admitted=len(admitted),
                calm_calls=len(solo) + len(calm_loaded), calm_ttft_solo=solo_ttft,
                calm_ttft_during_flood=loaded_ttft,
                calm_ttft_p99_ratio=round(loaded_ttft["p99_ms"] / solo_ttft["p99_ms"], 3))
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


# ---- F6: Redis down before a session request --------------------------------------------------

async def f6_redis_down(ctx: Context, result: Result) -> None:
    redis = RedisServer()
    srv = await start_server(ctx, session_spec(redis.url))
    num_refused = ctx.size(32, 8)
    try:
        async with client_for(srv.url) as client:
            first = await session_turn(client, "f6-kept", 0)
            if first.status != 200:
                result.fail([f"session call with Redis up: {first.status} {first.error}"])
            redis.stop()
            health: list[float] = []

            async def probe_health() -> None:
                for _ in range(40):
                    t0 = time.monotonic()
                    await client.get("/health")
                    health.append(time.monotonic() - t0)
                    await asyncio.sleep(0.02)

            refused, stateless, _ = await asyncio.gather(
                asyncio.gather(*(session_turn(client, f"f6-down-{i}", 0, tag="redis-down")
                                 for i in range(num_refused))),
                asyncio.gather(*(checked_stream(ctx, client, result, 16, "default",
                                                "stateless") for _ in range(4))),
                probe_health())
            result.num_requests += 1 + num_refused
            for rec in refused:
                result.fail(check_rejection(rec, 503, "session_store_unavailable"))
            ready = (await client.get("/ready")).json()
            if ready.get("session_store") != "degraded":
                result.fail([f"/ready says session_store={ready.get('session_store')!r} while "
                             f"Redis is down, want 'degraded'"])
            await asyncio.to_thread(redis.start)
            after = await _until_ok(client, "f6-kept", 1)
            result.num_requests += 1
            if after.status != 200:
                result.fail([f"session call after Redis came back: {after.status}"])
            # no generation started for a refused turn: those sessions were never created
            for i in range(num_refused):
                r = await client.get(f"/v1/conversations/f6-down-{i}")
                if r.status_code != 404:
                    result.fail([f"f6-down-{i}: a refused session exists ({r.status_code})"])
            result.metrics.update(
                rejection_latency=percentiles_ms([r.latency_s for r in refused]),
                health_during_outage=percentiles_ms(health),
                stateless_ok=sum(r.status == 200 for r in stateless))
            result.metrics["stored"] = await exactly_once(srv.url, {"f6-kept": [0, 1]}, result)
            await finish_checks(ctx, client, result)
    finally:
        srv.stop()
        redis.close()


# ---- F7: Redis restart mid-stream (link reset, then a server restart) -------------------------

async def f7_redis_restart_mid_stream(ctx: Context, result: Result) -> None:
    num_sessions, max_tokens = ctx.size(8, 3), 100
    redis = RedisServer()
    proxy = TcpProxy(redis.port)
    await proxy.start()
    srv = await start_server(ctx, session_spec(proxy.url, 20.0))  # 100 tokens: about 2 s
    sessions = [f"f7-{i}" for i in range(num_sessions)]
    try:
        async with client_for(srv.url) as client:
            for sid in sessions:  # turn 0 with the link up
                rec = await session_turn(client, sid, 0)
                if rec.status != 200:
                    result.fail([f"{sid} turn 0: {rec.status} {rec.error}"])

            async def round_with(k: int, fault) -> None:
                streams = [asyncio.create_task(session_turn(client, sid, k, max_tokens, True,
                                                            f"turn-{k}")) for sid in sessions]
                await asyncio.sleep(0.5)  # user turns stored, streams running
                await fault()
                for rec in await asyncio.gather(*streams):
                    result.fail(_ok_stream(rec, max_tokens))

            async def cut_link() -> None:  # every connection reset; the commits meet the cut
                proxy.cut(down_s=2.5)

            async def restart_redis() -> None:
                await asyncio.to_thread(redis.restart, 1.5)

            await round_with(1, cut_link)
            await round_with(2, restart_redis)
            result.num_requests += 3 * num_sessions
            result.metrics["stored"] = await exactly_once(
                srv.url, {sid: [0, 1, 2] for sid in sessions}, result)
            await finish_checks(ctx, client, result)
    finally:
        srv.stop()
        await proxy.close()
        redis.close()


# ---- F8: kill -9 Redis right after acknowledged turns -----------------------------------------

async def f8_redis_killed(ctx: Context, result: Result) -> None:
    num_sessions = ctx.size(16, 4)
    redis = RedisServer()
    srv = await start_server(ctx, session_spec(redis.url, 20.0))
    sessions = [f"f8-{i}" for i in range(num_sessions)]
    try:
        async with client_for(srv.url) as client:
            for sid in sessions:
                rec = await session_turn(client, sid, 0)
                if rec.status != 200:
                    result.fail([f"{sid} turn 0: {rec.status} {rec.error}"])
            # a stream's 200 means its user turn is stored: kill Redis right then
            body = turn_body(sessions[0], 1, 60)
            async with client.stream("POST", CHAT, json={**body, "stream": True},
                                     headers=key_of(sessions[0], 1)) as r:
                redis.crash()
                await asyncio.sleep(0.5)
                await asyncio.to_thread(redis.start)
                text = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            result.num_requests += num_sessions + 1
            if r.status_code != 200 or text[-1] != "data: [DONE]" or \
                    any('"error"' in line for line in text):
                result.fail([f"stream across the crash: status {r.status_code}, last event "
                             f"{text[-1] if text else None!r}"])
            sent = {sid: [0] for sid in sessions}
            sent[sessions[0]] = [0, 1]
            result.metrics["stored"] = await exactly_once(srv.url, sent, result)
            await finish_checks(ctx, client, result)
    finally:
        srv.stop()
        redis.close()


# ---- F9: Redis slow (2 s added per exchange) --------------------------------------------------

async def f9_redis_slow(ctx: Context, result: Result) -> None:
    num_calls = ctx.size(32, 8)
    redis = RedisServer()
    proxy = TcpProxy(redis.port)
    await proxy.start()
    srv = await start_server(ctx, session_spec(proxy.url))
    try:
        async with client_for(srv.url) as client:
            first = await session_turn(client, "f9-kept", 0)
            if first.status != 200:
                result.fail([f"session call with Redis fast: {first.status}"])
            proxy.delay_s = 2.0
            slow, stateless = await asyncio.gather(
                asyncio.gather(*(session_turn(client, f"f9-slow-{i}", 0, tag="redis-slow")
                                 for i in range(num_calls))),
                asyncio.gather(*(checked_stream(ctx, client, result, 16, "default",
                                                "stateless") for _ in range(4))))
            result.num_requests += 1 + num_calls
            deadline_s = 3 * STORE_TIMEOUT_S + 2.0  # the store's timeouts, not a hang
            for rec in slow:
                if rec.status != 200:
                    result.fail(check_rejection(rec, 503, "session_store_unavailable"))
                if rec.latency_s is None or rec.latency_s > deadline_s:
                    result.fail([f"a session call took {rec.latency_s} s with Redis slow "
                                 f"(deadline {deadline_s} s)"])
            if proxy.max_open > 64:
                result.fail([f"{proxy.max_open} connections to Redis at once; the pool "
                             f"allows 64"])
            proxy.delay_s = 0.0
            after = await _until_ok(client, "f9-kept", 1)
            if after.status != 200:
                result.fail([f"session call once Redis was fast again: {after.status}"])
            result.metrics.update(
                session_latency=percentiles_ms([r.latency_s for r in slow if r.latency_s is not None]),
                answered={str(s): sum(r.status == s for r in slow) for s in (200, 503)},
                redis_connections_max=proxy.max_open,
                quotas="token buckets live in the server process, so a slow Redis cannot "
                       "slow them or open them (no fail-open/closed choice to make)")
            stored = {"f9-kept": [0, 1]}
            stored.update({f"f9-slow-{i}": [0] for i, r in enumerate(slow) if r.status == 200})
            result.metrics["stored"] = await exactly_once(srv.url, stored, result)
            await finish_checks(ctx, client, result)
    finally:
        srv.stop()
        await proxy.close()
        redis.close()


# ---- F16: a retry with the same Idempotency-Key -----------------------------------------------

async def f16_idempotent_retry(ctx: Context, result: Result) -> None:
    redis = RedisServer()
    srv = await start_server(ctx, session_spec(redis.url, 20.0))
    try:
        async with client_for(srv.url) as client:
            # 1. the client gives up after 0.3 s (the server sees it leave) and retries
            try:
                await client.post(CHAT, json=turn_body("f16-a", 0, 60),
                                  headers=key_of("f16-a", 0), timeout=0.3)
                result.fail(["the first call was meant to time out on the client"])
            except httpx.TimeoutException:
                pass
            retry = await _retry_past_409(client, "f16-a", 0)
            tokens_before = await metric_total(client, "ultrafast_generation_tokens")
            again = await plain_call(client, turn_body("f16-a", 0, 60), "replay", CHAT,
                                     key_of("f16-a", 0))
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
            result.fail(_ok_stream(first_rec, 60))
            replay = await session_turn(client, "f16-b", 0, 60, True, "replay-stream")
            if replay.text != first_rec.text or replay.num_done != 1:
                result.fail(["the replayed stream differs from the first call's answer"])
            result.num_requests += 6
            result.metrics["stored"] = await exactly_once(
                srv.url, {"f16-a": [0], "f16-b": [0]}, result)
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
