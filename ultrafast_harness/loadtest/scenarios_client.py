"""Misbehaving clients (docs/RELIABILITY.md 7b: F12, F12b, F13, B0) against the real server (fake
executor), each while canary streams run, each followed by the "nothing lost" checks: a reader
that stalls or never resumes, slowloris heads and bodies, too many connections from one
address, and malformed or oversized bodies.
"""

from __future__ import annotations

import asyncio
import time

from ultrafast_harness.loadtest.client import http_request_bytes, open_raw, parse_raw_sse
from ultrafast_harness.loadtest.harness import Context, Result, ServerSpec
from ultrafast_harness.loadtest.invariants import check_content, check_terminal
from ultrafast_harness.loadtest.scenarios_fault import FAULT_SERVER, with_canaries
from ultrafast_harness.loadtest.scenarios_load import client_for, fake_body, finish_checks


async def f12_slow_reader(ctx: Context, result: Result) -> None:
    """A client with a 4 KB receive buffer that stops reading: others unaffected, and when it
    reads again its stream is complete and exact (nothing dropped while it stalled)."""
    srv = ctx.server(FAULT_SERVER)
    stall_s = ctx.size(10.0, 2.0)
    tokens = 120
    async with client_for(srv.url) as client:

        async def fault():
            body, expected = fake_body(ctx, tokens)
            reader, writer = await open_raw(srv.url, rcvbuf_bytes=4096)
            writer.write(http_request_bytes(srv.url, {**body, "stream": True}))
            await writer.drain()
            await asyncio.sleep(stall_s)  # read nothing while the server keeps producing
            raw = await asyncio.wait_for(reader.read(-1), timeout=60)
            writer.close()
            rec = parse_raw_sse(raw, "slow-reader", body)
            rec.usage = {"completion_tokens": tokens}  # raw calls do not ask for usage
            result.num_requests += 1
            result.fail(check_terminal(rec) + check_content(rec, expected, tokens))

        await with_canaries(ctx, client, result, fault)
        await finish_checks(ctx, client, result)


SLOW_CLIENT_SERVER = ServerSpec(
    num_slots=4,
    fake_step_ms=20.0,
    extra=("--header-timeout-s", "2", "--body-timeout-s", "2", "--max-connections-per-ip", "48"),
)


async def f13_slowloris(ctx: Context, result: Result) -> None:
    """Headers dribbled at 1 byte per 0.2 s, a body that stops half way, and more connections
    than the per-IP cap, while canaries stream: each is cut, the server keeps serving."""
    srv = ctx.server(SLOW_CLIENT_SERVER)
    drip_s = ctx.size(12.0, 5.0)  # longer than the 2 s timeouts of this server
    async with client_for(srv.url) as client:

        async def dribble_head() -> bytes:
            reader, writer = await open_raw(srv.url)
            answer = asyncio.create_task(_read_all(reader, drip_s + 2.0))
            head = http_request_bytes(srv.url, {"prompt": [5, 6], "max_tokens": 1})
            t_end = time.monotonic() + drip_s
            for byte in head[:-10]:
                if time.monotonic() > t_end or answer.done():  # answered and closed
                    break
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except (ConnectionError, OSError):
                    break
                await asyncio.sleep(0.2)
            writer.close()
            return await answer

        async def stall_body() -> bytes:
            reader, writer = await open_raw(srv.url)
            full = http_request_bytes(srv.url, {"prompt": [5, 6], "max_tokens": 1})
            writer.write(full[: full.index(b"\r\n\r\n") + 4 + 5])  # head + 5 bytes of body
            await writer.drain()
            answer = await _read_all(reader, drip_s)
            writer.close()
            return answer

        async def fault():
            return await asyncio.gather(dribble_head(), stall_body())

        head_answer, body_answer = await with_canaries(ctx, client, result, fault)
        result.num_requests += 2
        if not head_answer.startswith(b"HTTP/1.1 408"):
            result.fail([f"dribbled headers: no 408 within {drip_s:.0f} s ({head_answer[:40]!r})"])
        if not body_answer.startswith(b"HTTP/1.1 408") or b"request_timeout" not in body_answer:
            result.fail([f"stalled body: no 408 request_timeout ({body_answer[:60]!r})"])
        result.metrics["connection_cap"] = await _over_the_cap(srv.url, 48, result)
        health = await client.get("/health")
        if health.status_code != 200:
            result.fail([f"/health {health.status_code} after the slow clients"])
        await finish_checks(ctx, client, result)


async def _read_all(reader, timeout_s: float) -> bytes:
    """What arrives until EOF, a reset or the timeout (bytes before a reset are kept)."""
    chunks = []
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            chunk = await asyncio.wait_for(reader.read(4096), timeout=left)
            if not chunk:
                break
            chunks.append(chunk)
    except (asyncio.TimeoutError, ConnectionError):
        pass
    return b"".join(chunks)


async def _over_the_cap(url: str, cap: int, result: Result) -> dict:
    """Open cap + 1 idle connections: the ones over the cap get 429 too_many_connections at
    once, the others stay silent (read well within the 2 s head timeout)."""
    held = [await open_raw(url) for _ in range(cap + 1)]
    try:
        answers = await asyncio.gather(*(_read_all(reader, 1.0) for reader, _ in held))
    finally:
        for _, writer in held:
            writer.close()
    result.num_requests += len(held)
    refused = [a for a in answers if a]
    if not refused:
        result.fail([f"{len(held)} connections from one address, none refused (cap {cap})"])
    for answer in refused:
        if not answer.startswith(b"HTTP/1.1 429") or b"too_many_connections" not in answer:
            result.fail(
                [f"a connection over the cap got {answer[:60]!r}, want 429 too_many_connections"]
            )
    return {"opened": len(held), "refused": len(refused), "cap": cap}


async def f12b_stalled_reader(ctx: Context, result: Result) -> None:
    """A reader that never resumes: once the server's buffers are full for the write-stall
    timeout (2 s here), the connection is aborted and its KV slots are freed."""
    srv = ctx.server(
        ServerSpec(num_slots=8, fake_step_ms=2.0, extra=("--write-stall-timeout-s", "2")),
        fresh=True,
    )
    try:
        async with client_for(srv.url) as client:
            body = {
                "prompt": ctx.fake_prompt(),
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
                "n": 8,
                "logprobs": 5,
            }  # about 10 MB of events
            reader, writer = await open_raw(srv.url, rcvbuf_bytes=4096)
            writer.write(http_request_bytes(srv.url, body))
            await writer.drain()
            result.num_requests += 1
            started, deadline = time.monotonic(), time.monotonic() + ctx.size(60.0, 30.0)
            while "the client read nothing" not in srv.log_tail(20000):
                if time.monotonic() > deadline:
                    result.fail(
                        [
                            "the stalled reader was never cut (no write-stall abort in "
                            "the server log)"
                        ]
                    )
                    break
                await asyncio.sleep(0.2)
            result.metrics["cut_after_s"] = round(time.monotonic() - started, 1)
            try:  # the server aborted it: the client sees the rest of its buffer, then a reset
                await asyncio.wait_for(reader.read(-1), timeout=10)
            except (asyncio.TimeoutError, ConnectionError):
                pass
            writer.close()
            await finish_checks(ctx, client, result)  # every slot of the 8 choices is free
    finally:
        srv.stop()


BAD_BODIES = [
    b"{not json",
    b"[]",
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "temperature": "hot"}',
    b'{"prompt": [99999999]}',
    b'{"prompt": "x", "n": 1000}',
    b"\xff\xfe garbage",
    b'{"prompt": "x"' + b" " * 10,
]


async def b0_bad_inputs(ctx: Context, result: Result) -> None:
    """Malformed and oversized bodies mid-load: each gets the error envelope, canaries exact."""
    srv = ctx.server(FAULT_SERVER)
    async with client_for(srv.url) as client:

        async def fault():
            for raw in BAD_BODIES + [b'{"prompt": "' + b"a" * (5 << 20) + b'"}']:
                r = await client.post(
                    "/v1/completions", content=raw, headers={"content-type": "application/json"}
                )
                result.num_requests += 1
                body = (
                    r.json()
                    if r.headers.get("content-type", "").startswith("application/json")
                    else {}
                )
                if not 400 <= r.status_code < 500 or set(body.get("error", {})) != {
                    "message",
                    "type",
                    "param",
                    "code",
                }:
                    result.fail(
                        [f"bad body {raw[:24]!r}: status {r.status_code}, not a 4xx error envelope"]
                    )

        await with_canaries(ctx, client, result, fault)
        await finish_checks(ctx, client, result)
