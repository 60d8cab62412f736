"""A real `redis-server` child on a free loopback port, in its own directory (tests, benchmarks).

Never the default port and never the system's data: `--dir` is a temporary directory, AOF with
`appendfsync always`, so a restart (`restart()`) keeps every acknowledged write, as
docs/RELIABILITY.md F7/F8 assume. `redis-server` comes from the project's setup (`make setup`
unpacks it into `.tools/bin`, local_tools.py), else from PATH.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ultrafast.local_tools import find_tool
from ultrafast_harness.bench.server_process import free_port


class RedisServerMissing(RuntimeError):
    pass


class RedisServer:
    def __init__(
        self,
        data_dir: str | Path | None = None,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        """`extra_args`: more redis-server options (`--requirepass`, `--user`, `--tls-port`
        ...); the plain port stays open on loopback, so readiness is seen without them."""
        binary = find_tool("redis-server")
        if binary is None:
            raise RedisServerMissing(
                "redis-server is not in .tools/bin nor on PATH: run `make setup` "
                "(scripts/fetch_tools.sh unpacks it there)"
            )
        self.binary = binary
        self._own_dir = data_dir is None
        self.dir = Path(data_dir or tempfile.mkdtemp(prefix="ultrafast-redis-"))
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout_s: float = 20.0) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--protected-mode",
                "yes",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if self._answers():
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up, with a password
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM: redis flushes the AOF and exits; connections see a reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def crash(self) -> None:
        """SIGKILL: no flush, no goodbye (docs/RELIABILITY.md F8); only the AOF written so far
        stays."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
