"""`ultrafast cluster`: N engine replicas on Ray Serve behind one OpenAI ingress on --port.

    ultrafast cluster --replicas 2 --session-store redis://127.0.0.1:6379/0

Takes every `serve` flag (each replica is a `serve` in all but its socket), plus --replicas,
--address (join a running Ray cluster; default: start a local one), --replica-cpus, and the
shared rate limits' --limits-store / --limits-fail. The cluster itself (Ray, the ingress app,
the admin-scoped POST /admin/rolling-restart) is cluster/run.py: `ultrafast serve` never
imports Ray.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_cluster_parser(sub: Any) -> None:
    from ultrafast.cli_help import SERVE_GROUPS, HelpFormatter, group
    from ultrafast.config import EngineConfig, ServerConfig
    from ultrafast.config_flags import add_flags

    p = sub.add_parser(
        "cluster",
        help="N engine replicas on Ray Serve behind one OpenAI endpoint (ultrafast[ray])",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model_path", nargs="?", default=None, help="as for `serve` (default: as there)")
    cluster = group(p, "cluster")
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
    for title in SERVE_GROUPS:
        group(p, title)
    # serve's flags but its log flags and several models (one model per replica; those fields
    # keep their defaults); a Redis KV tier lets a moved conversation restore, not recompute
    add_flags(p, ServerConfig, ("listen", "main"), group)
    add_flags(p, EngineConfig, None, group)
    p.set_defaults(func=cmd_cluster)


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
        server_config,
    )
    from ultrafast.cluster.replica import ReplicaSpec, with_replica_defaults
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
            engine=EngineConfig(model=model, **engine_options(args)),
            server=server,
            limits_store=args.limits_store or server.session_store,
            limits_fail=args.limits_fail,
            num_cpus=args.replica_cpus,
        )
    )
    from ultrafast.cluster.run import run_cluster

    return run_cluster(spec, args.replicas, args.address, direct=args.relay == "direct")
