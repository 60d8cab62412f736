"""Run `ultrafast cluster` as a child process on a free loopback port (tests, load scenarios,
the cluster benchmark). Its log goes to a temporary file (`log_tail` for failures)."""

from __future__ import annotations

import os
import signal
import tempfile

import httpx

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench.server_process import free_port, spawn_cli, stop_child, wait_healthy


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
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ultrafast-cluster-", suffix=".log")
        self.proc = spawn_cli(
            ["cluster", model, "--port", str(self.port), "--replicas", str(replicas)]
            + ["--threads", "1", *args],
            self.log,
        )
        # the ingress listens once every replica runs (/health needs no key, /ready may)
        if not wait_healthy(self.proc, self.url, startup_timeout_s, self.log_tail):
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
        code = stop_child(self.proc, grace_s=60.0)  # the ingress stops Serve and Ray
        self.log.close()
        return code
