"""Each connection's kernel send buffer is capped (http_timeouts.TimedH11Protocol), so a client
that reads nothing holds a bounded amount of the server's memory and its stall is noticed."""

import asyncio
import socket

import uvicorn

from ultrafast.server.http_timeouts import protocol_class


async def _empty_app(scope, receive, send):  # never reached: the test only connects
    raise AssertionError("no request was sent")


def _server_side_sndbuf(send_buffer_bytes: int) -> int:
    seen: list[int] = []
    base = protocol_class(send_buffer_bytes=send_buffer_bytes)

    class Probe(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport):
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))

    async def run() -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(
                _empty_app,
                host="127.0.0.1",
                port=port,
                http=Probe,
                lifespan="off",
                log_level="error",
            )
        )
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.should_exit = True
        await task

    asyncio.run(run())
    assert len(seen) == 1
    return seen[0]


def test_connections_get_the_configured_send_buffer():
    capped = _server_side_sndbuf(64 * 1024)
    assert 64 * 1024 <= capped <= 2 * 64 * 1024  # Linux reports twice the value set
    assert _server_side_sndbuf(0) != capped  # 0 leaves the kernel's default alone
