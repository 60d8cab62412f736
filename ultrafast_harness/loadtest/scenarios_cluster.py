"""The cluster's faults (docs/RELIABILITY.md 7c: C1-C4) on `ultrafast cluster`: 2 replicas on
the fake executor, one redis-server. Skipped (failed with the reason) without Ray.

C1 kills a replica under streaming load: every stream ends with its finish or an error event,
then [DONE] (never silence), and every session's next turn succeeds with each turn stored once.
C2 restarts Redis mid-conversation. C3 runs a rolling restart under load: no accepted call is
lost. C4 sends one tenant through both replicas: it gets its bucket's depth once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile

from ultrafast_harness.bench.redis_server import RedisServer
from ultrafast_harness.loadtest.client import CallRecord, plain_call, stream_call
from ultrafast_harness.loadtest.harness import Context, Result
from ultrafast_harness.loadtest.invariants import check_terminal
from ultrafast_harness.loadtest.scenarios_load import client_for
from ultrafast_harness.loadtest.scenarios_state import CHAT, exactly_once, session_turn

FAKE = (
    *("--executor", "fake", "--fake-step-ms", "20", "--num-slots", "8"),
    *("--priority-ttft-ms", "10000", "--default-queue", "64"),
)


async def _cluster(redis: RedisServer, *extra: str):
    from ultrafast_harness.cluster.process import ClusterProcess

    return await asyncio.to_thread(ClusterProcess, *FAKE, "--session-store", redis.url, *extra)


def _needs_ray(result: Result) -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        result.fail(["ray is not installed: pip install 'ultrafast[ray]'"])
        return False
    return True


def _stream_problems(rec: CallRecord) -> list[str]:
    """A stream through a replica that may die: its finish or an error event, then [DONE]."""
    if rec.status != 200:
        return [f"{rec.tag}: status {rec.status} {rec.error}"]
    if rec.num_error_events:
        return [] if rec.num_done == 1 else [f"{rec.tag}: error event without [DONE]"]
    return check_terminal(rec)


async def c1_replica_kill(ctx: Context, result: Result) -> None:
    if not _needs_ray(result):
        return
    redis = RedisServer()
    cluster = await _cluster(redis)
    sessions = [f"c1-{i}" for i in range(ctx.size(16, 6))]
    sent: dict[str, list[int]] = {sid: [] for sid in sessions}
    try:
        async with client_for(cluster.url) as client:
            for sid in sessions:
                rec = await session_turn(client, sid, 0)
                result.num_requests += 1
                if rec.status == 200:
                    sent[sid].append(0)
                else:
                    result.fail([f"{sid} turn 0: {rec.status} {rec.error}"])
            body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
            streams = [
                asyncio.ensure_future(
                    stream_call(client, dict(body), "long", path="/v1/completions")
                )
                for _ in range(8)
            ]
            await asyncio.sleep(1.0)
            victim = sorted(cluster.replicas())[0]
            await asyncio.to_thread(cluster.kill_replica, victim)
            cut = 0
            for rec in await asyncio.gather(*streams):
                result.num_requests += 1
                result.fail(_stream_problems(rec))
                cut += bool(rec.num_error_events)
            result.metrics["streams_cut_by_the_kill"] = cut
            for sid in sessions:
                rec = await session_turn(client, sid, 1)
                result.num_requests += 1
                if rec.status == 200:
                    sent[sid].append(1)
                else:
                    result.fail([f"{sid} turn after the kill: {rec.status} {rec.error}"])
        result.metrics.update(await exactly_once(cluster.url, sent, result))
    finally:
        await asyncio.to_thread(cluster.stop)
        redis.close()


async def c2_redis_restart(ctx: Context, result: Result) -> None:
    if not _needs_ray(result):
        return
    redis = RedisServer()
    cluster = await _cluster(redis)
    sessions = [f"c2-{i}" for i in range(ctx.size(12, 4))]
    sent: dict[str, list[int]] = {sid: [] for sid in sessions}
    try:
        async with client_for(cluster.url) as client:
            for k in range(3):
                if k == 1:
                    await asyncio.to_thread(redis.restart)
                for sid in sessions:
                    rec = await session_turn(client, sid, k)
                    for _ in range(20):  # 503 session_store_unavailable while Redis comes back
                        if rec.status != 503:
                            break
                        await asyncio.sleep(0.25)
                        rec = await session_turn(client, sid, k)
                    result.num_requests += 1
                    if rec.status == 200:
                        sent[sid].append(k)
                    else:
                        result.fail([f"{sid} turn {k}: {rec.status} {rec.error}"])
        result.metrics.update(await exactly_once(cluster.url, sent, result))
    finally:
        await asyncio.to_thread(cluster.stop)
        redis.close()


async def c3_rolling_restart(ctx: Context, result: Result) -> None:
    if not _needs_ray(result):
        return
    redis = RedisServer()
    cluster = await _cluster(redis)
    records: list[CallRecord] = []
    try:
        async with client_for(cluster.url) as client:
            restart = asyncio.ensure_future(client.post("/admin/rolling-restart", timeout=600))
            body = {"prompt": "x", "max_tokens": 16, "ignore_eos": True, "stream": True}
            while not restart.done():
                batch = [stream_call(client, dict(body), "load", path="/v1/completions")]
                plain = {**body, "stream": False}
                batch += [plain_call(client, plain, "load", path="/v1/completions")]
                records += await asyncio.gather(*batch)
            answer = await restart
            if answer.status_code != 200:
                result.fail([f"rolling restart: {answer.status_code} {answer.text[:200]}"])
        for rec in records:
            result.num_requests += 1
            if rec.status == 200:  # accepted: it must finish whole
                result.fail(check_terminal(rec) if rec.body.get("stream") else [])
                if rec.num_error_events:
                    result.fail([f"an accepted stream ended with an error: {rec.error}"])
            elif rec.status not in (429, 503):
                result.fail([f"status {rec.status} during the restart: {rec.error}"])
        result.metrics["calls_during_restart"] = len(records)
    finally:
        await asyncio.to_thread(cluster.stop)
        redis.close()


async def c4_tenant_over_limit(ctx: Context, result: Result) -> None:
    if not _needs_ray(result):
        return
    key, depth = "uf-loadtest-c4", 5
    spec = {
        "tenants": [
            {
                "name": "c4",
                "requests_per_s": 0.002,
                "burst_s": depth * 500,
                "keys": [{"sha256": hashlib.sha256(key.encode()).hexdigest()}],
            }
        ]
    }
    keys = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(spec, keys)
    keys.close()
    redis = RedisServer()
    cluster = await _cluster(redis, "--api-keys", keys.name)
    try:
        async with client_for(cluster.url) as client:
            client.headers["Authorization"] = f"Bearer {key}"
            replicas, codes = set(), []
            for i in range(4 * depth):
                body = {
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 2,
                    "session_id": f"c4-{i}",  # sessions spread over both replicas
                }
                rec = await plain_call(client, body, "tenant", path=CHAT)
                codes.append(rec.status)
                replicas.add(rec.headers.get("x-ultrafast-replica"))
            result.num_requests += len(codes)
            if codes.count(200) != depth or codes.count(429) != len(codes) - depth:
                result.fail([f"granted {codes.count(200)} of a {depth}-deep bucket: {codes}"])
            if len(replicas) < 2:
                result.fail([f"the calls reached only {replicas}"])
    finally:
        await asyncio.to_thread(cluster.stop)
        redis.close()
