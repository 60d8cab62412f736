"""`ultrafast cluster`: N engine replicas on Ray Serve behind one OpenAI ingress on --port.

    ultrafast cluster --replicas 2 --session-store redis://127.0.0.1:6379/0

Takes every `serve` flag (each replica is a `serve` in all but its socket), plus --replicas,
--address (join a running Ray cluster; default: start a local one), --replica-cpus, and the
shared rate limits' --limits-store / --limits-fail. Ray is imported only here and in app.py:
`ultrafast serve` never needs it. The admin-scoped POST /admin/rolling-restart redeploys the
replicas one by one (each new one serves before the old one drains).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from typing import Any

log = logging.getLogger("ultrafast.cluster")


def add_cluster_parser(sub: Any) -> None:
    from ultrafast.cli_help import HelpFormatter, group
    from ultrafast.cli_serve import (
        _add_access_args,
        _add_guard_args,
        _add_kv_cache_args,
        _add_sampling_args,
        _add_session_args,
        _add_tier_args,
        add_chat_template_arg,
        add_engine_args,
    )
    from ultrafast.config import ServerConfig

    p = sub.add_parser(
        "cluster",
        help="N engine replicas on Ray Serve behind one OpenAI endpoint (ultrafast[ray])",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model_path", nargs="?", default=None, help="as for `serve` (default: as there)")
    cluster, server = group(p, "cluster"), group(p, "server")
    cluster.add_argument(
        "--replicas", type=int, default=2, help="engine replicas (each its own process)"
    )
    cluster.add_argument(
        "--address", default=None, help="join this Ray cluster (default: start a local one)"
    )
    cluster.add_argument("--replica-cpus", type=float, default=0.5, help="Ray CPUs per replica")
    cluster.add_argument(
        "--limits-store",
        default=None,
        help="redis://... holding tenants' rate limits for all replicas (default: the "
        "session store)",
    )
    cluster.add_argument(
        "--limits-fail",
        choices=["open", "closed"],
        default="open",
        help="when the limits' Redis is unreachable: open = each replica limits alone, "
        "closed = refuse rate-limited calls (429)",
    )
    cluster.add_argument(
        "--relay",
        choices=["direct", "ray"],
        default="direct",
        help="how HTTP calls reach a replica on the ingress's machine: direct = its own "
        "loopback port (fewer hops), ray = through its Serve handle (other machines' "
        "replicas and WebSockets always use the handle)",
    )
    server.add_argument("--host", default=ServerConfig.host, help="ingress bind address")
    server.add_argument("--port", type=int, default=ServerConfig.port, help="ingress TCP port")
    server.add_argument(
        "--served-model-name",
        default=ServerConfig.served_model_name,
        help="model id clients send (default: the model's directory or file name)",
    )
    add_chat_template_arg(group(p, "model"))
    _add_sampling_args(group(p, "sampling"))
    _add_tier_args(p)
    _add_session_args(p)
    _add_access_args(p)
    _add_guard_args(p)
    _add_kv_cache_args(p)  # a Redis KV tier lets a moved conversation restore instead of recompute
    add_engine_args(p)
    # one model per replica: serve's --models flags are not offered, their defaults stand
    p.set_defaults(
        func=cmd_cluster,
        models=[],
        pin=[],
        max_resident_bytes="0",
        keep_alive="5m",
        model_load_timeout_s=ServerConfig.model_load_timeout_s,
        no_preload=False,
        log_level=ServerConfig.log_level,
        no_access_log=not ServerConfig.access_log,
    )


def cmd_cluster(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError(
            "`ultrafast cluster` needs Ray: pip install 'ultrafast[ray]' (ray[serve]==2.60.0)"
        ) from None
    from ultrafast.cli_serve import (
        check_max_model_len,
        chosen_model,
        engine_options,
        kv_cache_options,
        server_config,
    )
    from ultrafast.cluster.app import ReplicaSpec, with_replica_defaults
    from ultrafast.config import EngineConfig

    if args.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    if args.threads is None:
        args.threads = 1  # replicas share the machine: one kernel thread each unless told
    model, served_name = chosen_model(args.model_path or args.model)
    check_max_model_len(model, args.max_model_len)
    if args.served_model_name is None:
        args.served_model_name = served_name
    server = server_config(args)
    if server.auth_on:  # a bad keys file fails here, not in every replica
        from ultrafast.server.tenants import server_api_keys

        server_api_keys(server.api_keys_path, server.api_key_hashes)
    spec = with_replica_defaults(
        ReplicaSpec(
            engine=EngineConfig(model=model, **engine_options(args), **kv_cache_options(args)),
            server=server,
            limits_store=args.limits_store or server.session_store,
            limits_fail=args.limits_fail,
            num_cpus=args.replica_cpus,
        )
    )
    return run_cluster(spec, args.replicas, args.address, direct=args.relay == "direct")


def start_ray(address: str | None, replicas: int, num_cpus: float) -> None:
    import ray
    from ray import serve

    from ultrafast.cluster.app import runtime_env

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

    from ultrafast.cluster.app import RayBackends, app_name, deploy_replica

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

    from ultrafast.cluster.app import deploy_replica
    from ultrafast.cluster.health import ReplicaPoller, merge_metrics
    from ultrafast.cluster.ingress import ClusterIngress
    from ultrafast.cluster.ingress_app import build_ingress_app
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


if __name__ == "__main__":
    from ultrafast.cli import main

    sys.exit(main())
