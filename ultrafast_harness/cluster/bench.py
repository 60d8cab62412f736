"""The cluster benchmark (needs ultrafast[ray] and redis-server; loopback only):

1. priority TTFT p50/p99 through the cluster ingress (1 replica) vs a single `ultrafast serve`,
   each under the same default-tier background load;
2. default-tier throughput (completion tokens/s) with 2 replicas vs 1;
3. session continuation TTFT after a replica kill vs the same sessions' warm TTFT; the
   replicas share a Redis KV tier (--kv-store), so moved sessions restore their KV.

    python -m ultrafast_harness.cluster.bench --duration-s 20 --out runs/cluster-bench.json

Tiny settings (`--duration-s 3 --sessions 4`) run in about three minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from ultrafast_harness.bench.redis_server import RedisServer
from ultrafast_harness.bench.server_process import ServerProcess

COMMON = ("--threads", "1", "--num-slots", "4", "--max-model-len", "2048")


async def _ttft(client: httpx.AsyncClient, body: dict, where: dict | None = None):
    """Seconds to the first content chunk, and the completion tokens streamed; `where` gets
    the replica that answered."""
    started = time.monotonic()
    first, n = None, 0
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if where is not None:
            where["replica"] = r.headers.get("x-ultrafast-replica")
        if r.status_code != 200:
            await r.aread()
            return None, 0
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                n += 1
                if first is None:
                    first = time.monotonic() - started
    return first, n


def _chat(text: str, max_tokens: int, tier: str = "default", **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "service_tier": tier,
        **extra,
    }


async def _load(url: str, duration_s: float, concurrency: int, probe: bool) -> dict:
    """`concurrency` default streams back to back; with `probe`, priority calls one at a time."""
    deadline = time.monotonic() + duration_s
    tokens, probes = [0], []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def background(i: int) -> None:
            while time.monotonic() < deadline:
                _, n = await _ttft(client, _chat(f"def load_{i}(x):", 32, ignore_eos=True))
                tokens[0] += n

        async def prober() -> None:
            while time.monotonic() < deadline:
                t, _ = await _ttft(client, _chat("def probe(x):", 4, "priority"))
                if t is not None:
                    probes.append(t)
                await asyncio.sleep(0.1)

        jobs = [background(i) for i in range(concurrency)] + ([prober()] if probe else [])
        started = time.monotonic()
        await asyncio.gather(*jobs)
        elapsed = time.monotonic() - started
    out = {"tokens_per_s": round(tokens[0] / elapsed, 1)}
    if probes:
        probes.sort()
        out["priority_ttft_p50_ms"] = round(1000 * statistics.median(probes), 1)
        out["priority_ttft_p99_ms"] = round(1000 * probes[int(0.99 * (len(probes) - 1))], 1)
        out["num_probes"] = len(probes)
    return out


async def _replaced(cluster, name: str, old_pid: int, timeout_s: float = 180.0) -> float:
    """Wait until Ray has started `name` again (a new pid, ready); seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        info = (await asyncio.to_thread(cluster.replicas)).get(name, {})
        if info.get("ready") and int(info.get("pid") or old_pid) != old_pid:
            return time.monotonic() - started
        await asyncio.sleep(0.25)
    raise RuntimeError(f"replica {name} was not replaced in {timeout_s:.0f} s")


async def _continuation(cluster, sessions: int, kv_url: str, after_kill: str = "now") -> dict:
    """Warm turn TTFT vs the first turn after the sessions' replica is killed: at once
    (`now`, the replacement then starts on the same cores), or once Ray has replaced it."""
    warm, after = [], []
    async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
        homes = {}
        for turn in range(3):
            for s in range(sessions):
                body = _chat(f"def s{s}_t{turn}(x):", 4, session_id=f"bench-{s}")
                where: dict = {}
                t, _ = await _ttft(client, body, where)
                if turn == 2 and t is not None:
                    warm.append(t)
                homes[s] = where.get("replica")
        victim = homes[0]
        if victim is None:
            raise RuntimeError("the cluster named no replica for the sessions' turns")
        await _kv_written(kv_url)  # the victim's sessions' KV is in Redis
        hits_before = await _l3_hits(client)
        pid = await asyncio.to_thread(cluster.kill_replica, victim)
        waited_s = await _replaced(cluster, victim, pid) if after_kill == "replaced" else 0.0
        moved = [s for s, home in homes.items() if home == victim]
        for s in moved:
            t, _ = await _ttft(client, _chat(f"def s{s}_after(x):", 4, session_id=f"bench-{s}"))
            if t is not None:
                after.append(t)
        hits_after = await _l3_hits(client)
    return {
        "warm_ttft_ms": round(1000 * statistics.median(warm), 1) if warm else None,
        "after_kill_ttft_ms": [round(1000 * t, 1) for t in after],
        "sessions_moved": len(moved),
        "after_kill": after_kill,
        "waited_for_replacement_s": round(waited_s, 1),
        # prompt tokens whose KV came from Redis after the kill (0: the moves recomputed)
        "kv_tokens_restored_from_redis": hits_after - hits_before,
    }


async def _kv_written(redis_url: str, timeout_s: float = 30.0) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while not await client.keys("uf:kv:*") and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        await client.aclose()


async def _l3_hits(client: httpx.AsyncClient) -> float:
    """Prompt tokens served from the Redis KV tier, over the replicas now running."""
    text = (await client.get("/metrics")).text
    series = 'ultrafast_kv_tier_hit_tokens_total{replica="all",tier="L3_redis"}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(series))


def run(args) -> dict:
    from ultrafast_harness.cluster.process import ClusterProcess

    results: dict = {"settings": vars(args)}
    redis = RedisServer()
    try:
        single = ServerProcess(
            "--threads", "1", "--session-store", redis.url, num_slots=4, max_model_len=2048
        )
        try:
            results["single_serve"] = asyncio.run(
                _load(single.url, args.duration_s, args.concurrency, True)
            )
        finally:
            single.stop()
        for replicas in (1, 2):
            cluster = ClusterProcess(
                *COMMON,
                "--session-store",
                redis.url,
                "--kv-store",
                redis.url,
                replicas=replicas,
            )
            try:
                results[f"cluster_{replicas}"] = asyncio.run(
                    _load(cluster.url, args.duration_s, args.concurrency * replicas, True)
                )
                if replicas == 2:
                    continuation = _continuation(cluster, args.sessions, redis.url, args.after_kill)
                    results["continuation"] = asyncio.run(continuation)
            finally:
                cluster.stop()
    finally:
        redis.close()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration-s", type=float, default=20.0, help="per load phase")
    p.add_argument("--concurrency", type=int, default=2, help="default streams per replica")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument(
        "--after-kill",
        choices=["now", "replaced"],
        default="now",
        help="send the moved sessions' turns at once after the kill, or once Ray has started "
        "the replacement (on 2 cores its start shares the cores with the surviving replica)",
    )
    p.add_argument("--out", default="runs/cluster-bench.json")
    args = p.parse_args(argv)
    results = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
