"""Run `ultrafast cluster` as a child process on a free loopback port (tests, load scenarios,
the cluster benchmark). Its log goes to a temporary file (`log_tail` for failures)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from ultrafast.bench.server_process import free_port
from ultrafast.config import DEMO_MODEL_DIR


class ClusterProcess:
    def __init__(
        self,
        *args: str,
        replicas: int = 2,
        model: str = str(DEMO_MODEL_DIR),
        startup_timeout_s: float = 240.0,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "ultrafast.cli",
            "cluster",
            model,
            "--port",
            str(self.port),
            "--replicas",
            str(replicas),
            "--threads",
            "1",
            *args,
        ]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ultrafast-cluster-", suffix=".log")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cluster exited at startup: {self.log_tail()}")
            try:
                # the ingress listens once every replica runs (/ready may need a key)
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the cluster did not start in {startup_timeout_s} s")

    def replicas(self, headers: dict | None = None) -> dict:
        """name -> {pid, ready, ...} from the ingress's /ready."""
        r = httpx.get(self.url + "/ready", headers=headers or {}, timeout=10)
        return r.json().get("replicas", {})

    def kill_replica(self, name: str, headers: dict | None = None) -> int:
        pid = int(self.replicas(headers)[name]["pid"])
        os.kill(pid, signal.SIGKILL)
        return pid

    def log_tail(self, num_chars: int = 3000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-num_chars:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the ingress stops Serve and Ray
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
