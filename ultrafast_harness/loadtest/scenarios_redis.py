"""The session store's faults (docs/RELIABILITY.md 7b: F6-F9) on a real redis-server: down before a
session request, restarted mid-stream, killed right after acknowledged turns, and slow.

Each scenario starts its own redis-server and its own server on the fake executor, and stops
both at the end. F7 and F9 put a TcpProxy between the server and Redis to cut or slow the link.
"Exactly once" is checked on the stored conversation items (scenarios_state.py's helpers).
"""

from __future__ import annotations

import asyncio
import time

from ultrafast_harness.bench.redis_server import RedisServer
from ultrafast_harness.loadtest.harness import Context, Result
from ultrafast_harness.loadtest.invariants import check_rejection, percentiles_ms
from ultrafast_harness.loadtest.scenarios_load import checked_stream, client_for, finish_checks
from ultrafast_harness.loadtest.scenarios_state import (
    CHAT,
    STORE_TIMEOUT_S,
    exactly_once,
    key_of,
    ok_stream,
    session_spec,
    session_turn,
    start_server,
    turn_body,
    until_ok,
)
from ultrafast_harness.loadtest.tcp_proxy import TcpProxy

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
                asyncio.gather(
                    *(
                        session_turn(client, f"f6-down-{i}", 0, tag="redis-down")
                        for i in range(num_refused)
                    )
                ),
                asyncio.gather(
                    *(
                        checked_stream(ctx, client, result, 16, "default", "stateless")
                        for _ in range(4)
                    )
                ),
                probe_health(),
            )
            result.num_requests += 1 + num_refused
            for rec in refused:
                result.fail(check_rejection(rec, 503, "session_store_unavailable"))
            ready = (await client.get("/ready")).json()
            if ready.get("session_store") != "degraded":
                result.fail(
                    [
                        f"/ready says session_store={ready.get('session_store')!r} while "
                        f"Redis is down, want 'degraded'"
                    ]
                )
            await asyncio.to_thread(redis.start)
            after = await until_ok(client, "f6-kept", 1)
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
                stateless_ok=sum(r.status == 200 for r in stateless),
            )
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
                streams = [
                    asyncio.create_task(session_turn(client, sid, k, max_tokens, True, f"turn-{k}"))
                    for sid in sessions
                ]
                await asyncio.sleep(0.5)  # user turns stored, streams running
                await fault()
                for rec in await asyncio.gather(*streams):
                    result.fail(ok_stream(rec, max_tokens))

            async def cut_link() -> None:  # every connection reset; the commits meet the cut
                proxy.cut(down_s=2.5)

            async def restart_redis() -> None:
                await asyncio.to_thread(redis.restart, 1.5)

            await round_with(1, cut_link)
            await round_with(2, restart_redis)
            result.num_requests += 3 * num_sessions
            result.metrics["stored"] = await exactly_once(
                srv.url, {sid: [0, 1, 2] for sid in sessions}, result
            )
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
            async with client.stream(
                "POST", CHAT, json={**body, "stream": True}, headers=key_of(sessions[0], 1)
            ) as r:
                redis.crash()
                await asyncio.sleep(0.5)
                await asyncio.to_thread(redis.start)
                text = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            result.num_requests += num_sessions + 1
            if (
                r.status_code != 200
                or text[-1] != "data: [DONE]"
                or any('"error"' in line for line in text)
            ):
                result.fail(
                    [
                        f"stream across the crash: status {r.status_code}, last event "
                        f"{text[-1] if text else None!r}"
                    ]
                )
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
                asyncio.gather(
                    *(
                        session_turn(client, f"f9-slow-{i}", 0, tag="redis-slow")
                        for i in range(num_calls)
                    )
                ),
                asyncio.gather(
                    *(
                        checked_stream(ctx, client, result, 16, "default", "stateless")
                        for _ in range(4)
                    )
                ),
            )
            result.num_requests += 1 + num_calls
            deadline_s = 3 * STORE_TIMEOUT_S + 2.0  # the store's timeouts, not a hang
            for rec in slow:
                if rec.status != 200:
                    result.fail(check_rejection(rec, 503, "session_store_unavailable"))
                if rec.latency_s is None or rec.latency_s > deadline_s:
                    result.fail(
                        [
                            f"a session call took {rec.latency_s} s with Redis slow "
                            f"(deadline {deadline_s} s)"
                        ]
                    )
            if proxy.max_open > 64:
                result.fail([f"{proxy.max_open} connections to Redis at once; the pool allows 64"])
            proxy.delay_s = 0.0
            after = await until_ok(client, "f9-kept", 1)
            if after.status != 200:
                result.fail([f"session call once Redis was fast again: {after.status}"])
            result.metrics.update(
                session_latency=percentiles_ms(
                    [r.latency_s for r in slow if r.latency_s is not None]
                ),
                answered={str(s): sum(r.status == s for r in slow) for s in (200, 503)},
                redis_connections_max=proxy.max_open,
                quotas="token buckets live in the server process, so a slow Redis cannot "
                "slow them or open them (no fail-open/closed choice to make)",
            )
            stored = {"f9-kept": [0, 1]}
            stored.update({f"f9-slow-{i}": [0] for i, r in enumerate(slow) if r.status == 200})
            result.metrics["stored"] = await exactly_once(srv.url, stored, result)
            await finish_checks(ctx, client, result)
    finally:
        srv.stop()
        await proxy.close()
        redis.close()
