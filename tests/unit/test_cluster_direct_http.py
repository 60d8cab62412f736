"""The ingress's direct HTTP path to a replica's loopback port (cluster/direct_http.py), over
a real uvicorn socket: answers stream through as the handle path's items, and a replica that
is gone, or dies mid-answer, is ReplicaFailed (so the ingress retries or ends the stream)."""

import asyncio
import os
import signal
import subprocess
import sys

import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from ultrafast.cluster.direct_http import DirectHTTP, serve_on_loopback
from ultrafast.cluster.ingress import ReplicaFailed
from ultrafast_harness.bench.server_process import free_port


async def _events(request):
    async def gen():
        for i in range(3):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.01)

    body = await request.body()
    headers = {"x-echo": request.headers.get("x-echo", ""), "x-body": str(len(body))}
    return StreamingResponse(gen(), media_type="text/event-stream", headers=headers)


def _request(path="/v1/x", body=b"{}"):
    headers = [(b"x-echo", b"yes"), (b"content-length", b"999"), (b"host", b"127.0.0.1")]
    return {"method": "POST", "path": path, "headers": headers, "body": body, "query_string": b""}


def test_an_answer_streams_through_with_its_status_and_headers():
    async def go():
        app = Starlette(routes=[Route("/v1/x", _events, methods=["POST"])])
        port, task = await serve_on_loopback(app)
        direct = DirectHTTP()
        try:
            for _ in range(50):  # the server task starts listening on its next turns
                try:
                    items = [item async for item in direct.forward(port, _request(body=b"abc"))]
                    break
                except ReplicaFailed:
                    await asyncio.sleep(0.02)
            start, chunks = items[0], items[1:]
            headers = dict(start["headers"])
            assert start["status"] == 200 and headers["x-echo"] == "yes"
            assert headers["x-body"] == "3"  # the stale content-length was not forwarded
            assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        finally:
            await direct.close()
            task.cancel()

    asyncio.run(go())


def test_a_replica_that_is_gone_is_replica_failed_at_once():
    async def go():
        direct = DirectHTTP()
        with pytest.raises(ReplicaFailed):
            async for _ in direct.forward(free_port(), _request()):
                pass
        await direct.close()

    asyncio.run(go())


CHILD = """
import asyncio, sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route
async def endless(request):
    async def gen():
        while True:
            yield b"data: tick\\n\\n"
            await asyncio.sleep(0.05)
    return StreamingResponse(gen(), media_type="text/event-stream")
app = Starlette(routes=[Route("/v1/x", endless, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_a_replica_killed_mid_answer_is_replica_failed_not_a_hang():
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(port)])

    async def go():
        direct = DirectHTTP()
        for _ in range(200):
            try:
                stream = direct.forward(port, _request())
                start = await anext(stream)
                break
            except ReplicaFailed:
                await asyncio.sleep(0.05)
        assert start["status"] == 200
        assert (await anext(stream)).startswith(b"data: tick")
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(ReplicaFailed):
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass
        await direct.close()

    try:
        asyncio.run(go())
    finally:
        child.kill()
        child.wait()
