"""Run `ultrafast serve` as a child process on a free loopback port (benchmarks and e2e tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ultrafast.config import DEMO_MODEL_DIR


def serve_default_threads() -> int:
    """Every core but one: the benchmarks' fixed split for a server they start (serve itself
    measures its thread counts per pass width at start instead)."""
    from ultrafast.executors.ggml_exec import physical_cores

    # one core stays with the event loop, tokenizer and clients: kernels on every core compete
    # with them and slow streaming over HTTP on a small machine
    return max(1, physical_cores() - 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_cli(argv: list[str], stdout) -> subprocess.Popen:
    """`python -m ultrafast.cli ARGV...` as a child, its output unbuffered into `stdout`."""
    return subprocess.Popen(
        [sys.executable, "-m", "ultrafast.cli", *argv],
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_healthy(
    proc: subprocess.Popen, url: str, timeout_s: float, exit_output: Callable[[], str]
) -> bool:
    """Poll `url`/health until it answers 200 (True) or `timeout_s` passes (False); a child
    that exits first is a RuntimeError carrying `exit_output()`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited at startup (code {proc.returncode}): {exit_output()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False


def wait_start_costs(url: str, timeout_s: float = 300.0) -> None:
    """Until the server's start costs (thread plan, idle speed: engine/start_costs.py) are
    cached or measured: a measurement in the background would drop the slots' cached
    prefixes while a test or benchmark runs. A /ready that needs a key is not waited on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/ready", timeout=5)
        except httpx.HTTPError:
            return
        status = str(r.json().get("start_costs", "")) if r.status_code == 200 else ""
        if not status.startswith(("measuring", "re-measuring")):
            return
        time.sleep(0.2)


def wait_wide_pass(url: str, timeout_s: float = 300.0) -> str:
    """Until the wide path (executors/wide_lazy.py) has loaded and timed itself (its routing,
    then its GEMMs' weights) after a pass that needed it, so a benchmark measures the steady
    state, not a background load and a timing beside the peers; its /ready status at the
    end."""
    deadline, status = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/ready", timeout=5)
        except httpx.HTTPError:
            return status
        status = str(r.json().get("wide_pass", "")) if r.status_code == 200 else ""
        untimed = "timed when the engine is next idle" in status  # its GEMMs (wide_forward)
        if not status.startswith(("loading", "weights loaded")) and not untimed:
            return status
        time.sleep(0.2)
    return status


def stop_child(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    """SIGTERM (the server drains), SIGKILL after `grace_s`; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class ServerProcess:
    def __init__(
        self,
        *args: str,
        model: Path | str | None = DEMO_MODEL_DIR,  # None: the args name them (--models)
        num_slots: int = 4,
        max_model_len: int = 512,
        startup_timeout_s: float = 120.0,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ultrafast-serve-", suffix=".log")
        self.proc = spawn_cli(
            [
                "serve",
                *([] if model is None else [str(model)]),
                "--port",
                str(self.port),
                "--num-slots",
                str(num_slots),
                "--max-model-len",
                str(max_model_len),
                *args,
            ],
            self.log,
        )
        if not wait_healthy(self.proc, self.url, startup_timeout_s, self._output):
            self.stop()
            raise RuntimeError(f"server did not become healthy in {startup_timeout_s} s")
        wait_start_costs(self.url, startup_timeout_s)

    def output(self) -> str:
        """Everything the server printed so far (stdout and stderr): a file, not a pipe, so a
        long run's access log never fills a pipe buffer nobody reads and stalls the server."""
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def _output(self) -> str:
        return self.output()[-2000:]

    def stop(self) -> int:
        return stop_child(self.proc)
