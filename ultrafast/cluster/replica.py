"""Ray Serve deployments: each engine replica is its own Serve application (`engine-0`, ...)
of one replica that wraps the single server's app (server/app.py), engine and all.

One application per replica, not one deployment of N replicas: the ingress (ingress.py, in
the `ultrafast cluster` process) picks the replica itself, which Ray's routers cannot do for
it (they see headers only and queue FIFO across tiers; docs/ARCHITECTURE.md "Cluster"), and a
rolling restart redeploys one application at a time. Ray still owns each replica's life: it
restarts one whose process died or whose `check_health` raised.

`max_ongoing_requests` is set far above what a replica can run, so no call ever waits in
Ray's FIFO queue: queueing and refusals happen in the replica's tier-aware admission and
scheduler.

Needs the optional extra `ultrafast[ray]`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayError

from ultrafast.cluster.asgi_call import call_asgi
from ultrafast.cluster.asgi_websocket import WebSocketCalls
from ultrafast.cluster.direct_http import CountCalls, DirectHTTP
from ultrafast.cluster.ingress import ReplicaFailed
from ultrafast.config import EngineConfig, ServerConfig

log = logging.getLogger(__name__)

HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0
WATCH_CALL_S = 2.0  # a death watch call's least length (longer while direct calls run)


@dataclass
class ReplicaSpec:
    engine: EngineConfig
    server: ServerConfig
    limits_store: str | None = None  # redis://... : tenant rate limits shared by all replicas
    limits_fail: str = "open"
    num_cpus: float = 0.5


class EngineReplica:
    """One engine and the single server's app, driven through `forward` by the ingress."""

    def __init__(self, name: str, spec: ReplicaSpec, generation: int = 0):
        # `generation`: a rolling restart bumps it, which makes Ray replace the replica
        from ultrafast.server.app import build_app
        from ultrafast.server.build import build_state

        logging.basicConfig(level=logging.INFO)
        self.name = name
        self.state = build_state(spec.engine, spec.server)
        if spec.limits_store and self.state.api_keys is not None:
            from ultrafast.cluster.shared_limits import SharedLimits, share_buckets

            shared = SharedLimits(
                spec.limits_store, spec.limits_fail, ca_file=spec.server.redis_ca_file
            )
            share_buckets(self.state.api_keys, shared)
        self.app = build_app(self.state)
        self.websockets = WebSocketCalls(self.app)
        self.http_port: int | None = None  # the app on 127.0.0.1, for the ingress's direct calls
        self.direct_calls = CountCalls(self.app)
        self._http_task: asyncio.Task | None = None

    def _bridge(self) -> None:
        """The bridge needs the loop the calls run on: made at the first call, as the
        single server's lifespan makes it at start."""
        self.state.models.default.bridge_on_loop(self.state.config.max_stream_buffer_events)

    async def forward(self, request: dict) -> AsyncIterator[Any]:
        self._bridge()
        async for item in call_asgi(self.app, request):
            yield item

    async def ws_open(self, conn_id: str, request: dict) -> AsyncIterator[dict]:
        """A relayed WebSocket (/v1/realtime): what the app sends, as asgi_websocket.py says."""
        self._bridge()
        async for item in self.websockets.open(conn_id, request):
            yield item

    async def ws_push(self, conn_id: str, message: dict) -> bool:
        return await self.websockets.push(conn_id, message)

    async def watch(self) -> AsyncIterator[int]:
        """A call that lasts WATCH_CALL_S: Ray breaks it (ActorDiedError) the moment this
        process dies, so the ingress learns of a death at once, not at its next poll."""
        yield os.getpid()
        await asyncio.sleep(WATCH_CALL_S)
        # a stopping replica stays up while this call runs (Ray waits for its own calls):
        # so it lasts until the ingress's direct calls here are done too
        while self.direct_calls.in_flight > 0:
            await asyncio.sleep(0.05)

    async def routing_stats(self) -> dict:
        if self.http_port is None:  # on the loop the calls run on (the first call's)
            from ultrafast.cluster.direct_http import serve_on_loopback

            self._bridge()
            self.http_port, self._http_task = await serve_on_loopback(self.direct_calls)
        state = self.state
        snap = state.models.snapshot()
        costs = snap.step_costs
        admission = state.models.default.admission
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "http_port": self.http_port,
            "ready": state.models.alive and not state.draining,
            "base_s": costs.base_s,
            "per_token_s": costs.per_token_s,
            "per_seq_s": costs.per_seq_s,
            "num_running": snap.num_running,
            "num_waiting": snap.num_waiting,
            "num_slots": snap.num_kv_slots_total,
            "pending_tokens": {t.api_name: n for t, n in admission.pending_prefill_tokens.items()},
            "in_flight": {t.api_name: n for t, n in admission.in_flight.items()},
            "ttft_target_s": {
                name: t["ttft_ms"] / 1000 for name, t in admission.describe_targets().items()
            },
        }

    async def metrics_text(self) -> str:
        body, _ = self.state.metrics.render()
        return body.decode() if isinstance(body, bytes) else str(body)

    async def check_health(self) -> None:
        """Ray calls this every HEALTH_CHECK_PERIOD_S; raising makes Ray replace the replica."""
        if not self.state.models.alive:
            raise RuntimeError(f"engine dead: {self.state.models.dead_reason}")

    def __del__(self) -> None:  # Ray's graceful stop: the engine thread ends with the replica
        try:
            from ultrafast.server.bridge import shutdown_engine

            shutdown_engine(self.state.models.default.live)
        except Exception:
            pass


def max_ongoing_requests(server: ServerConfig) -> int:
    """Far above what the replica admits, so Ray never queues a call (it would queue FIFO)."""
    admitted = server.priority.max_in_flight + server.default.max_in_flight
    return 4 * (admitted + server.flex.max_in_flight) + 64


def app_name(index: int) -> str:
    return f"engine-{index}"


def deploy_replica(index: int, spec: ReplicaSpec, generation: int = 0) -> None:
    deployment: Any = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=1,
        max_ongoing_requests=max_ongoing_requests(spec.server),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=spec.server.drain_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
        ray_actor_options={"num_cpus": spec.num_cpus},
    )
    name = app_name(index)
    # returns at once (the caller waits for RUNNING, so replicas start in parallel); on a
    # redeploy Ray keeps the old replica serving until the new one is up, then stops it
    # gracefully: its calls in flight finish
    bound = deployment.bind(name, spec, generation)
    serve._run(bound, _blocking=False, name=name, route_prefix=None)


class RayBackends:
    """The ingress's Backends over Serve handles, one application per replica. HTTP calls to
    a replica on the ingress's own node go straight to its loopback port (direct_http.py)
    unless `direct` is off."""

    def __init__(self, count: int, direct: bool = True):
        self.count = count
        self._handles: dict[str, Any] = {}
        self.direct = DirectHTTP() if direct else None
        self.ports: dict[str, int] = {}  # replica -> its loopback port, same node only
        self._node_id = ray.get_runtime_context().get_node_id()

    def names(self) -> list[str]:
        return [app_name(i) for i in range(self.count)]

    def _handle(self, name: str):
        handle = self._handles.get(name)
        if handle is None:
            handle = serve.get_app_handle(name)
            self._handles[name] = handle
        return handle

    async def forward(self, name: str, request: dict) -> AsyncIterator[Any]:
        port = self.ports.get(name)
        if self.direct is not None and port:
            async for item in self.direct.forward(port, request):
                yield item
            return
        try:
            stream = self._handle(name).options(stream=True).forward.remote(request)
            async for item in stream:
                yield item
        except (RayError, RuntimeError) as exc:  # the actor died, or the app is gone
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None

    async def ws_open(self, name: str, conn_id: str, request: dict) -> AsyncIterator[dict]:
        try:
            stream = self._handle(name).options(stream=True).ws_open.remote(conn_id, request)
            async for item in stream:
                yield item
        except (RayError, RuntimeError) as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None

    async def ws_push(self, name: str, conn_id: str, message: dict) -> bool:
        try:
            return await self._handle(name).ws_push.remote(conn_id, message)
        except (RayError, RuntimeError) as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None

    async def watch(self, name: str) -> AsyncIterator[int]:
        try:
            async for pid in self._handle(name).options(stream=True).watch.remote():
                yield pid
        except (RayError, RuntimeError) as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None

    async def running(self) -> dict:
        """name -> whether Serve reports its application RUNNING (a controller call)."""
        apps = await asyncio.to_thread(lambda: serve.status().applications)
        return {n: str(apps[n].status).endswith("RUNNING") for n in self.names() if n in apps}

    async def stats(self, name: str) -> dict:
        stats = await self._handle(name).routing_stats.remote()
        if stats.get("node_id") == self._node_id and stats.get("http_port"):
            self.ports[name] = int(stats["http_port"])  # a restarted replica: its new port
        else:
            self.ports.pop(name, None)
        return stats

    async def metrics_text(self, name: str) -> str:
        return await self._handle(name).metrics_text.remote()


def runtime_env() -> dict:
    """Replicas import ultrafast from where this process does (a checkout or the venv)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path}
    for var in ("ULTRAFAST_MODEL", "XDG_DATA_HOME", "OMP_NUM_THREADS"):
        if var in os.environ:
            env[var] = os.environ[var]
    return {"env_vars": env}


def with_replica_defaults(spec: ReplicaSpec) -> ReplicaSpec:
    """Replicas keep no process-wide state of their own: the session store must be shared."""
    store = spec.server.session_store or ""
    if not store.startswith("redis://"):
        raise ValueError("a cluster needs --session-store redis://... (every replica reads it)")
    return replace(spec)
