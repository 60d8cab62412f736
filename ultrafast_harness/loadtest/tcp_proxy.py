"""A loopback TCP proxy between the server and Redis, to inject the network faults F7 and F9.

`cut(down_s)` resets every open connection (RST, as a crashed peer or a dropped link would) and
refuses new ones for `down_s`; `delay_s` holds each chunk that long in both directions (a slow
Redis). It counts connections so a scenario can check the server's pool never piles up.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

from ultrafast_harness.bench.server_process import free_port


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.host = host
        self.target_port = target_port
        self.port = free_port()
        self.delay_s = 0.0
        self.max_open = 0  # the most connections open at once
        self.num_accepted = 0
        self._down_until_s = 0.0
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._reset_all()
            await self._server.wait_closed()

    def cut(self, down_s: float) -> None:
        """Reset every connection now and refuse new ones for `down_s`."""
        self._down_until_s = time.monotonic() + down_s
        self._reset_all()

    def _reset_all(self) -> None:
        for writer in list(self._open):
            _reset(writer)
        self._open.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._down_until_s:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            _reset(writer)
            return
        self.num_accepted += 1
        self._open.update((writer, up_writer))
        self.max_open = max(self.max_open, len(self._open) // 2)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
            )
        except asyncio.CancelledError:
            pass  # the proxy (or the loop) is closing: end this connection quietly
        for w in (writer, up_writer):
            self._open.discard(w)
            w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        finally:
            if writer in self._open:  # one side ended: end the other (a cut already reset it)
                _reset(writer)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), not FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.close()
