"""Run a cluster: start (or join) Ray, deploy N engine replicas, and serve the ingress app
with /ready, /metrics and the admin-scoped POST /admin/rolling-restart, which redeploys the
replicas one by one (each new one serves before the old one drains). Ray is imported only here
and in replica.py; `ultrafast cluster` (cli_cluster.py) parses the flags and calls `run_cluster`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

log = logging.getLogger("ultrafast.cluster")


def start_ray(address: str | None, replicas: int, num_cpus: float) -> None:
    import ray
    from ray import serve

    from ultrafast.cluster.replica import runtime_env

    if address:
        ray.init(address=address, runtime_env=runtime_env(), log_to_driver=False)
    else:
        ray.init(
            num_cpus=max(2, int(replicas * num_cpus + 0.999)),
            include_dashboard=False,
            object_store_memory=80 * 1024 * 1024,
            runtime_env=runtime_env(),
            log_to_driver=False,
        )
    serve.start(proxy_location="Disabled")  # the ingress below is the only HTTP front


def wait_running(names: list[str], timeout_s: float = 300.0) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        apps = serve.status().applications
        states = {n: str(apps[n].status) if n in apps else "MISSING" for n in names}
        if all(s.endswith("RUNNING") for s in states.values()):
            return
        failed = [n for n, s in states.items() if s.endswith("DEPLOY_FAILED")]
        if failed:
            raise RuntimeError(f"replica {failed[0]} failed to start: {apps[failed[0]].message}")
        time.sleep(0.5)
    raise RuntimeError(f"replicas not running after {timeout_s} s")


def run_cluster(spec, replicas: int, address: str | None, direct: bool = True) -> int:
    import uvicorn
    from ray import serve

    from ultrafast.cluster.replica import RayBackends, app_name, deploy_replica

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    started = time.monotonic()
    start_ray(address, replicas, spec.num_cpus)
    try:
        for i in range(replicas):
            deploy_replica(i, spec)
        wait_running([app_name(i) for i in range(replicas)])
        backends = RayBackends(replicas, direct=direct)
        app, poller = build_cluster_app(backends, spec)
        from ultrafast.cluster.health import DeathWatch

        watch = DeathWatch(poller.router, backends.names, backends.watch)
        from ultrafast.server.http_timeouts import protocol_class
        from ultrafast.server.unread_body import CloseOnUnreadBody

        cfg = spec.server
        config = uvicorn.Config(
            CloseOnUnreadBody(app),
            host=cfg.host,
            port=cfg.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_keep_alive=5,
            h11_max_incomplete_event_size=16 * 1024,
            # the single server's slowloris, stalled-reader and per-client limits, at the door
            http=protocol_class(
                cfg.header_timeout_s,
                cfg.write_stall_timeout_s,
                cfg.body_timeout_s,
                cfg.max_connections_per_ip,
            ),
        )
        server = uvicorn.Server(config)

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            await poller.poll_once()
            poller.start()
            watch.start()
            print(
                f"ultrafast cluster ready: {replicas} replicas of {spec.engine.model}"
                f" on http://{spec.server.host}:{spec.server.port} "
                f"({time.monotonic() - started:.1f} s)",
                flush=True,
            )
            yield
            poller.stop()
            watch.stop()

        app.router.lifespan_context = lifespan
        server.run()
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()
    return 0


def build_cluster_app(backends, spec):
    """The ingress app with /ready, /metrics and /admin/rolling-restart over these backends."""
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, PlainTextResponse, Response

    from ultrafast.cluster.health import ReplicaPoller, merge_metrics
    from ultrafast.cluster.ingress import ClusterIngress
    from ultrafast.cluster.ingress_app import build_ingress_app
    from ultrafast.cluster.replica import deploy_replica
    from ultrafast.cluster.router import Router, RouterConfig
    from ultrafast.server import auth
    from ultrafast.server.errors import APIError
    from ultrafast.server.tenants import server_api_keys

    server = spec.server
    targets = {t: getattr(server, t).ttft_ms / 1000 or 1e9 for t in ("priority", "default", "flex")}
    router = Router(backends.names(), RouterConfig(ttft_target_s=targets))
    ingress = ClusterIngress(
        backends, router, server.served_model_name or "", max_body_bytes=server.max_body_bytes
    )
    poller = ReplicaPoller(
        router, backends.names, backends.stats, running=getattr(backends, "running", None)
    )
    restart_lock = asyncio.Lock()

    async def ready(http: HTTPRequest) -> Response:
        direct = getattr(backends, "ports", {})  # replicas the ingress calls past Ray
        replicas = {
            n: {
                **{k: v for k, v in s.items() if k in ("ready", "pid", "num_running", "in_flight")},
                "relay": "direct" if n in direct else "ray",
            }
            for n, s in poller.last.items()
        }
        up = any(s.get("ready") for s in poller.last.values())
        body = {"status": "ready" if up else "no_replica", "replicas": replicas}
        return JSONResponse(body, status_code=200 if up else 503)

    async def metrics(http: HTTPRequest) -> Response:
        names = backends.names()
        texts = await asyncio.gather(
            *(asyncio.wait_for(backends.metrics_text(n), 5) for n in names),
            return_exceptions=True,
        )
        per = {n: t for n, t in zip(names, texts) if isinstance(t, str)}
        up = {n: bool(poller.last.get(n, {}).get("ready")) for n in names}
        return PlainTextResponse(merge_metrics(per, router, up))

    async def rolling_restart(http: HTTPRequest) -> Response:
        tenant = auth.tenant_of(http.scope)
        if api_keys is not None and not tenant.has_scope("admin"):
            raise APIError(403, "needs the admin scope", "permission_error", "forbidden", None)
        if restart_lock.locked():
            raise APIError(409, "a rolling restart is running", "conflict_error", None, None)
        async with restart_lock:
            generation = time.time_ns()
            loop = asyncio.get_running_loop()
            for i, name in enumerate(backends.names()):
                await loop.run_in_executor(None, deploy_replica, i, spec, generation)
                await loop.run_in_executor(None, wait_running, [name])
        return JSONResponse({"restarted": backends.names()})

    api_keys = server_api_keys(server.api_keys_path, server.api_key_hashes)
    hosts = auth.allowed_hosts_for(server.host, server.allowed_hosts)
    app = build_ingress_app(ingress, metrics, ready, api_keys, hosts)
    from starlette.routing import Route

    app.router.routes.insert(0, Route("/admin/rolling-restart", rolling_restart, methods=["POST"]))
    return app, poller
