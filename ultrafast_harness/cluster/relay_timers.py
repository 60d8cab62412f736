"""Where a cluster call's time goes: single idle priority calls (not a load test) timed to their
first content chunk and their end, through each path the ingress can take to one replica:

- the replica's app called in this process (no Ray, no socket): the floor;
- the replica's Serve handle stream (`--relay ray`);
- the replica's loopback port (`--relay direct`, direct_http.py);
plus the ingress's own work per call (JSON parse, route_request, Router.choose).

    python -m ultrafast_harness.cluster.relay_timers --calls 30

Needs ultrafast[ray] and redis-server; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench.redis_server import RedisServer

BODY = {
    "messages": [{"role": "user", "content": "def probe(x):"}],
    "max_tokens": 4,
    "service_tier": "priority",
    "stream": True,
}


def _request() -> dict:
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
    return {
        "method": "POST",
        "path": "/v1/chat/completions",
        "query_string": b"",
        "headers": headers,
        "body": json.dumps(BODY).encode(),
        "client": ["127.0.0.1", 1],
    }


def _spec(redis_url: str):
    import argparse

    from ultrafast.cluster.replica import ReplicaSpec, with_replica_defaults
    from ultrafast.config import EngineConfig, ServerConfig
    from ultrafast.config_flags import add_flags, read_config

    parser = argparse.ArgumentParser()  # the cluster's serve flags, as `ultrafast cluster`
    add_flags(parser, ServerConfig, ("listen", "main"))
    add_flags(parser, EngineConfig)
    argv = ["--session-store", redis_url, "--threads", "1", "--num-slots", "4"]
    args = parser.parse_args([*argv, "--max-model-len", "2048"])
    engine = EngineConfig(**{**read_config(EngineConfig, args), "model": str(DEMO_MODEL_DIR)})
    server = ServerConfig(**read_config(ServerConfig, args))
    return with_replica_defaults(ReplicaSpec(engine=engine, server=server))


async def _timed(calls: int, forward: Callable[[], AsyncIterator]) -> dict:
    """Median / p90 ms to the first content chunk and to the end."""
    first, total = [], []
    for _ in range(calls):
        started = time.perf_counter()
        seen = False
        async for item in forward():
            if not seen and isinstance(item, bytes) and b'"content"' in item:
                first.append(time.perf_counter() - started)
                seen = True
        total.append(time.perf_counter() - started)
        await asyncio.sleep(0.05)

    def ms(xs: list[float]) -> list[float]:
        xs = sorted(xs)
        return [round(1000 * statistics.median(xs), 2), round(1000 * xs[int(0.9 * len(xs))], 2)]

    return {"first_content_ms_p50_p90": ms(first), "total_ms_p50_p90": ms(total)}


def _ingress_work_us(calls: int = 2000) -> float:
    """JSON parse + route_request + Router.choose, per call."""
    from starlette.datastructures import Headers

    from ultrafast.cluster.ingress import Homes, route_request
    from ultrafast.cluster.router import Router

    raw, homes, router = json.dumps(BODY).encode(), Homes(), Router(["engine-0", "engine-1"])
    started = time.perf_counter()
    for _ in range(calls):
        router.choose(route_request("/v1/chat/completions", Headers({}), json.loads(raw), homes))
    return round(1e6 * (time.perf_counter() - started) / calls, 1)


def run(calls: int) -> dict:
    import ray
    from ray import serve

    from ultrafast.cluster.replica import EngineReplica, RayBackends, app_name, deploy_replica
    from ultrafast.cluster.run import start_ray, wait_running

    out: dict = {"ingress_work_us_per_call": _ingress_work_us()}
    redis = RedisServer()
    try:
        spec = _spec(redis.url)
        start_ray(None, 1, spec.num_cpus)
        try:
            deploy_replica(0, spec)
            wait_running([app_name(0)])

            async def through_ray() -> None:
                for key, direct in (("ray_handle", False), ("direct_port", True)):
                    backends = RayBackends(1, direct=direct)
                    await backends.stats("engine-0")  # learns the loopback port
                    call = functools.partial(backends.forward, "engine-0", _request())
                    out[key] = await _timed(calls, call)
                start = time.perf_counter()
                for _ in range(calls):
                    await backends.stats("engine-0")
                out["ray_unary_call_ms"] = round(1000 * (time.perf_counter() - start) / calls, 2)

            asyncio.run(through_ray())
        finally:
            serve.shutdown()
            ray.shutdown()
        local = EngineReplica("local", spec)
        out["in_process"] = asyncio.run(_timed(calls, lambda: local.forward(_request())))
    finally:
        redis.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=30)
    print(json.dumps(run(p.parse_args(argv).calls), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
