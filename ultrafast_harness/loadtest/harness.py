"""What every scenario gets: the server under test, the time/count budget, expected outputs.

Servers are real `ultrafast serve` child processes on a free 127.0.0.1 port (logs to a file,
so a chatty fault can never block the server on a full pipe), keyed by their options and
reused across scenarios; a scenario that kills or drains its server asks for a fresh one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.executors.fake_exec import plain_word_tokens, reference_tokens
from ultrafast.progress import Progress
from ultrafast.tokenizer import Tokenizer
from ultrafast_harness.bench.server_process import free_port, stop_child, wait_healthy
from ultrafast_harness.loadtest.client import plain_call
from ultrafast_harness.loadtest.invariants import num_fds

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def require_loopback(url: str) -> str:
    host = urlsplit(url).hostname or ""
    if host not in LOOPBACK_HOSTS and not host.startswith("127."):
        raise ValueError(f"loadtest only targets loopback servers, not {host!r}")
    return url.rstrip("/")


@dataclass(frozen=True)
class ServerSpec:
    """How a scenario wants its server: the fake executor (exact control) or the demo model;
    with `models`, several named models (`serve --models`) within `max_resident_bytes`."""

    executor: str = "fake"  # fake | demo
    num_slots: int = 8
    max_model_len: int = 2048  # the fake executor's KV costs nothing; F15 needs the room
    fake_step_ms: float = 20.0
    extra: tuple[str, ...] = ()  # further `serve` flags
    models: tuple[tuple[str, str], ...] = ()  # (name, path); the first is the default
    max_resident_bytes: int = 0  # 0: no budget

    def model_args(self) -> list[str]:
        if not self.models:
            return [str(DEMO_MODEL_DIR)]
        args = ["--models", ",".join(f"{name}={path}" for name, path in self.models)]
        if self.max_resident_bytes:
            args += ["--max-resident-bytes", str(self.max_resident_bytes)]
        return args

    def argv(self, port: int) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "ultrafast.cli",
            "serve",
            *self.model_args(),
            "--port",
            str(port),
            "--num-slots",
            str(self.num_slots),
            "--max-model-len",
            str(self.max_model_len),
            "--priority-ttft-ms",
            "10000",
            # hundreds of concurrent calls from one loopback client: no per-IP cap unless the
            # scenario's own flags set one (they come later and win)
            "--max-connections-per-ip",
            "0",
        ]
        if self.executor == "fake":
            cmd += ["--executor", "fake", "--fake-step-ms", str(self.fake_step_ms)]
        return cmd + list(self.extra)


class ServerHandle:
    def __init__(self, spec: ServerSpec, startup_timeout_s: float = 120.0):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ultrafast-loadtest-", suffix=".log")
        self.proc = subprocess.Popen(
            spec.argv(self.port),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        if not wait_healthy(self.proc, self.url, startup_timeout_s, self.log_tail):
            self.stop()
            raise RuntimeError(f"server did not become healthy in {startup_timeout_s} s")
        time.sleep(0.2)  # let the probe's connection close before the count
        self.num_fds_at_start = num_fds(self.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, num_chars: int = 2000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-num_chars:]

    def stop(self) -> int:
        code = stop_child(self.proc)
        self.log.close()
        return code


class ExternalServer:
    """A server someone else started (`--url`): no pid control, no restarts."""

    def __init__(self, url: str):
        self.url = require_loopback(url)
        self.pid = None
        self.alive = True
        self.spec = None

    def stop(self) -> int:
        return 0


@dataclass
class Budget:
    duration_s: float
    max_requests: int
    started_s: float = field(default_factory=time.monotonic)
    num_started: int = 0

    def more(self) -> bool:
        """May one more request start? Counts it when yes."""
        if (
            self.num_started >= self.max_requests
            or time.monotonic() - self.started_s > self.duration_s
        ):
            return False
        self.num_started += 1
        return True

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_s


@dataclass
class Result:
    name: str
    title: str
    status: str = "pass"  # pass | fail | skipped | error
    violations: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)  # spec items this server does not meet yet
    metrics: dict = field(default_factory=dict)
    num_requests: int = 0
    duration_s: float = 0.0

    def fail(self, problems: list[str]) -> None:
        self.violations.extend(problems)


class Context:
    def __init__(
        self,
        duration_s: float,
        max_requests: int,
        ci: bool,
        url: str | None = None,
        progress_stream=None,
    ):
        self.duration_s = duration_s
        self.max_requests = max_requests
        self.ci = ci
        self.url = require_loopback(url) if url else None
        self.progress_stream = progress_stream
        self.tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
        self.word_ids = plain_word_tokens(DEMO_MODEL_DIR / "tokenizer.json")
        self._servers: dict[ServerSpec, ServerHandle] = {}
        self.current: ServerHandle | None = None  # the shared server last handed out
        self._baselines: dict[tuple, str] = {}
        self._prompt_seq = 0

    def size(self, full, ci):
        return ci if self.ci else full

    def budget(self, max_requests: int | None = None, duration_s: float | None = None) -> Budget:
        return Budget(
            min(duration_s or self.duration_s, self.duration_s),
            min(max_requests or self.max_requests, self.max_requests),
        )

    def progress(self, label: str, total: int | None) -> Progress:
        return Progress(label, total=total, stream=self.progress_stream)

    def server(self, spec: ServerSpec, fresh: bool = False):
        self.current = None
        if self.url:  # the runner only sends external_ok scenarios here
            return ExternalServer(self.url)
        if fresh:
            return ServerHandle(spec)  # the scenario owns (and ends) it
        handle = self._servers.get(spec)
        if handle is None or not handle.alive:
            for other in list(self._servers.values()):  # one server at a time: 2 cores
                other.stop()
            self._servers.clear()
            handle = self._servers[spec] = ServerHandle(spec)
        self.current = handle
        return handle

    def close(self) -> None:
        for handle in self._servers.values():
            handle.stop()
        self._servers.clear()

    # ---- prompts and what they must produce -----------------------------------------------

    def fake_prompt(self, length: int = 8) -> list[int]:
        """A fresh token-id prompt (distinct per call, so no two calls share an answer)."""
        self._prompt_seq += 1
        n = self._prompt_seq
        return [
            self.word_ids[(n * 7919 + i * 104729) % len(self.word_ids)] for i in range(length - 2)
        ] + [n % 4000 + 10, n // 4000 + 10]

    def fake_expected(self, prompt: list[int], max_tokens: int) -> str:
        return self.tokenizer.decode(reference_tokens(prompt, max_tokens, self.word_ids))

    async def demo_baseline(self, client: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
        """The non-streamed temperature-0 answer of the demo model (the stream must match)."""
        key = (client.base_url, prompt, max_tokens)
        if key not in self._baselines:
            rec = await plain_call(
                client,
                {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                "baseline",
            )
            if rec.status != 200:
                raise RuntimeError(f"baseline call failed: {rec.status} {rec.error}")
            self._baselines[key] = rec.text
        return self._baselines[key]
