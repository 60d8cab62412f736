"""The tiered KV cache's faults (docs/RELIABILITY.md 7b: F30-F32) on the fake executor, whose
"KV" is the slot's token list: a wrongly restored slot changes the output tokens, so every
turn's exact output is the check that no conversation got another's KV.

F30 damages the saved blobs on disk and in Redis between two server processes, F31 takes the
disk tier away (a tiny budget, then the directory replaced by a file), F32 restarts Redis
while turns are saving. Each must end in recompute with the exact answer, never a crash or
a hang, and say so in the metrics.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
from pathlib import Path

from ultrafast.executors.fake_exec import reference_tokens
from ultrafast_harness.bench.redis_server import RedisServer
from ultrafast_harness.loadtest.client import plain_call
from ultrafast_harness.loadtest.harness import Context, Result, ServerSpec
from ultrafast_harness.loadtest.scenarios_load import client_for, finish_checks
from ultrafast_harness.loadtest.scenarios_state import start_server

TURN_TOKENS = 8


def kv_spec(*extra: str) -> ServerSpec:
    return ServerSpec(num_slots=2, fake_step_ms=5.0, extra=("--kv-host-cache-gb", "0.01", *extra))


class Conversation:
    """Token-id turns; the expected answer of each turn is known exactly (fake executor)."""

    def __init__(self, ctx: Context, length: int = 40):
        self.ctx = ctx
        self.tokens = ctx.fake_prompt(length)

    async def turn(self, client, result: Result, tag: str) -> int:
        """One turn; returns its cached prompt tokens (0 on a failure, which is recorded)."""
        expected = reference_tokens(self.tokens, TURN_TOKENS, self.ctx.word_ids)
        body = {"prompt": self.tokens, "max_tokens": TURN_TOKENS, "ignore_eos": True}
        rec = await plain_call(client, body, tag)
        result.num_requests += 1
        if rec.status != 200:
            result.fail([f"{tag}: status {rec.status} {rec.error or rec.transport_error}"])
            return 0
        if rec.text != self.ctx.tokenizer.decode(expected):
            result.fail([f"{tag}: the answer differs from the exact one (wrong KV restored)"])
        self.tokens = self.tokens + expected + self.ctx.fake_prompt(6)
        return ((rec.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def metric(client, name: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def _until(condition, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.1)):
        if await asyncio.to_thread(condition):
            return True
        await asyncio.sleep(0.1)
    return False


# ---- F30: corrupt, truncated and foreign blobs on disk and in Redis --------------------------


def _damage(blobs: list[bytes], i: int) -> bytes:
    """Conversation i's blob damaged one of five ways; `blobs` are all conversations' blobs."""
    data = blobs[i]
    kind = i % 5
    if kind == 4:  # forged: a payload byte changed and the sha256 trailer recomputed
        body = bytearray(data[:-32])
        body[-8] ^= 0x01
        return bytes(body) + hashlib.sha256(bytes(body)).digest()
    if kind == 0:
        return data[:40] + bytes([data[40] ^ 0xFF]) + data[41:]  # a flipped byte
    if kind == 1:
        return data[: len(data) // 2]  # truncated
    if kind == 2:
        return blobs[(i + 1) % len(blobs)]  # another conversation's (valid) blob
    return b"UFKV\x63\x00" + data[6:]  # a layout version this server does not read


async def f30_damaged_blobs(ctx: Context, result: Result) -> None:
    redis = RedisServer()
    disk = Path(tempfile.mkdtemp(prefix="uf-f30-"))
    spec = kv_spec("--kv-disk-dir", str(disk), "--kv-store", redis.url)
    convs = [Conversation(ctx) for _ in range(ctx.size(10, 5))]
    try:
        srv = await start_server(ctx, spec)
        try:
            async with client_for(srv.url) as client:
                for i, conv in enumerate(convs):
                    await conv.turn(client, result, f"f30-first-{i}")
        finally:
            srv.stop()  # a graceful stop: every write-through is flushed
        import redis as redis_client

        r = redis_client.Redis.from_url(redis.url)
        files = sorted(disk.glob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
        keys = [b"uf:kv:" + p.stem.encode() for p in files]
        if len(files) < len(convs) or any(not r.exists(k) for k in keys):
            result.fail(
                [f"{len(files)} blobs on disk for {len(convs)} saved turns, or not in Redis"]
            )
        blobs = [p.read_bytes() for p in files]
        for i, path in enumerate(files):
            damaged = _damage(blobs, i)
            path.write_bytes(damaged)
            r.set(keys[i], damaged)
        r.close()
        srv = await start_server(ctx, spec)
        try:
            async with client_for(srv.url) as client:
                for i, conv in enumerate(convs):
                    await conv.turn(client, result, f"f30-after-{i}")
                refused = await metric(client, "ultrafast_kv_blobs_refused_total")
                if refused < min(len(files), len(convs)):
                    result.fail([f"{refused:.0f} damaged blobs refused, want >= {len(convs)}"])
                result.metrics["refused_blobs"] = refused
                await finish_checks(ctx, client, result)
        finally:
            srv.stop()
    finally:
        redis.close()
        shutil.rmtree(disk, ignore_errors=True)


# ---- F31: the disk tier full (its hard budget), then gone ------------------------------------


async def f31_disk_full(ctx: Context, result: Result) -> None:
    disk = Path(tempfile.mkdtemp(prefix="uf-f31-")) / "kv"
    budget_gb = 4096 / (1 << 30)  # 4 KiB: a few of the fake executor's blobs
    srv = await start_server(
        ctx, kv_spec("--kv-disk-dir", str(disk), "--kv-disk-gb", f"{budget_gb:.12f}")
    )
    convs = [Conversation(ctx) for _ in range(ctx.size(12, 6))]
    try:
        async with client_for(srv.url) as client:
            for k in range(2):
                for i, conv in enumerate(convs):
                    await conv.turn(client, result, f"f31-budget-{k}-{i}")
            held = sum(p.stat().st_size for p in disk.glob("*.kv"))
            if held > 4096:
                result.fail([f"the disk tier holds {held} bytes over its 4096-byte limit"])
            disk.rename(disk.with_name("kv-gone"))  # atomic, while writes may be under way
            disk.write_text("the KV directory is gone")  # every write now fails
            for i, conv in enumerate(convs):
                await conv.turn(client, result, f"f31-gone-{i}")
            errors = await metric(client, 'ultrafast_kv_tier_errors_total{tier="L3_disk"}')
            degraded = await metric(client, 'ultrafast_kv_tier_degraded{tier="L3_disk"}')
            if errors < 1 or degraded != 1:
                result.fail([f"disk errors {errors:.0f}, degraded {degraded:.0f}: not reported"])
            result.metrics.update(disk_bytes_held=held, disk_errors=errors)
            await finish_checks(ctx, client, result)
    finally:
        srv.stop()
        shutil.rmtree(disk.parent, ignore_errors=True)


# ---- F32: Redis restarts while turns are saving ----------------------------------------------


async def f32_redis_restart(ctx: Context, result: Result) -> None:
    redis = RedisServer()
    srv = await start_server(ctx, kv_spec("--kv-store", redis.url))
    convs = [Conversation(ctx) for _ in range(ctx.size(8, 4))]
    try:
        async with client_for(srv.url) as client:

            async def talk(i: int, conv: Conversation) -> None:
                for k in range(3):
                    await conv.turn(client, result, f"f32-{i}-{k}")

            async def restart() -> None:
                await asyncio.sleep(0.05)
                await asyncio.to_thread(redis.restart, 0.5)

            await asyncio.gather(*(talk(i, c) for i, c in enumerate(convs)), restart())
            errors = await metric(client, 'ultrafast_kv_tier_errors_total{tier="L3_redis"}')

            def saved_again() -> bool:
                import redis as redis_client

                r = redis_client.Redis.from_url(redis.url)
                try:
                    return bool(r.keys("uf:kv:*"))
                finally:
                    r.close()

            # the tier is skipped for a moment after its last failure: turns go on until a
            # write-through lands again
            for attempt in range(20):
                await convs[attempt % len(convs)].turn(client, result, f"f32-after-{attempt}")
                if await _until(saved_again, timeout_s=0.5):
                    break
            else:
                result.fail(["no KV saved in Redis after it came back"])
            result.metrics["redis_errors_during_restart"] = errors
            await finish_checks(ctx, client, result)
    finally:
        srv.stop()
        redis.close()
