"""The cluster router (cluster/router.py) and the fleet simulation (cluster/simulate.py)."""

from ultrafast.cluster.router import Router, RouterConfig, RouteRequest, block_hashes, rendezvous
from ultrafast_harness.cluster.simulate import SimConfig, Simulation, replicas_needed

SYSTEM = "You are a careful assistant. " * 20


def _router(n=4, **config):
    return Router([f"r{i}" for i in range(n)], RouterConfig(**config))


def test_affinity_keeps_a_session_on_one_replica_and_moves_only_its_keys():
    router = _router()
    homes = {}
    for key in (f"sess-{i}" for i in range(40)):
        picks = {router.choose(RouteRequest(affinity_key=key)).replica for _ in range(3)}
        assert len(picks) == 1
        homes[key] = picks.pop()
    assert len(set(homes.values())) > 1  # keys spread over replicas
    router.mark_down("r1")
    for key, home in homes.items():
        decision = router.choose(RouteRequest(affinity_key=key))
        assert decision.replica != "r1"
        if home != "r1":
            assert decision.replica == home  # only the dead replica's sessions move
    assert router.decisions["default"]["affinity"] == 160


def test_rendezvous_is_independent_of_the_order_replicas_are_listed():
    names = ["a", "b", "c", "d"]
    assert rendezvous("k", names)[0] == rendezvous("k", list(reversed(names)))[0]


def test_prefix_routing_goes_where_the_prefix_is_cached_and_load_wins_when_it_is_not():
    router = _router()
    first = RouteRequest(prompt_text=SYSTEM + "question one")
    d1 = router.choose(first)
    router.dispatched(d1.replica, first)
    router.first_token(d1.replica, "default", first.prompt_tokens)
    d2 = router.choose(RouteRequest(prompt_text=SYSTEM + "question two"))
    assert (d2.replica, d2.reason) == (d1.replica, "prefix")
    # the prefix replica gets a deep queue: a cold replica now predicts a shorter TTFT
    router.report(d1.replica, {"pending_tokens": {"default": 100_000}})
    d3 = router.choose(RouteRequest(prompt_text=SYSTEM + "question three"))
    assert d3.replica != d1.replica and d3.reason == "load"


def test_dispatched_work_counts_until_the_replicas_next_report():
    router = _router(2)
    long_prompt = "x" * 40_000
    d1 = router.choose(RouteRequest(prompt_text=long_prompt))
    router.dispatched(d1.replica, RouteRequest(prompt_text=long_prompt))
    d2 = router.choose(RouteRequest(prompt_text="y" * 40_000))
    assert d2.replica != d1.replica  # the first one's prefill is still queued there


def test_priority_is_refused_with_retry_after_when_no_replica_meets_its_target():
    router = _router(2, ttft_target_s={"priority": 0.05, "default": 10.0, "flex": 60.0})
    for name in ("r0", "r1"):
        router.report(name, {"per_token_s": 0.001, "pending_tokens": {"priority": 2000}})
    refused = router.choose(RouteRequest(tier="priority", prompt_text="hello " * 10))
    assert refused.replica is None and refused.reason == "refused"
    assert refused.retry_after_s >= 1
    # the default tier is not refused by the router: the replica's own admission decides
    assert router.choose(RouteRequest(tier="default", prompt_text="hello")).replica is not None
    # a replica that frees up takes the priority request, even away from its session
    router.report("r1", {"per_token_s": 0.001, "pending_tokens": {}})
    moved = router.choose(RouteRequest(tier="priority", affinity_key="s", prompt_text="hi"))
    assert moved.replica == "r1"


def test_priority_waits_only_for_priority_work_ahead():
    router = _router(1, ttft_target_s={"priority": 0.05, "default": 10.0, "flex": 60.0})
    router.report("r0", {"per_token_s": 0.001, "pending_tokens": {"default": 5000}})
    assert router.choose(RouteRequest(tier="priority", prompt_text="hi")).replica == "r0"


def test_no_live_replica_is_unavailable():
    router = _router(1)
    router.mark_down("r0")
    decision = router.choose(RouteRequest())
    assert decision.replica is None and decision.reason == "unavailable"


def test_block_hashes_match_on_a_common_prefix_only():
    a, b = block_hashes(SYSTEM + "tail a"), block_hashes(SYSTEM + "other tail entirely")
    common = len(SYSTEM) // 64
    assert a[:common] == b[:common]
    assert block_hashes("z" + SYSTEM)[0] != a[0]


def test_simulation_routing_beats_random_on_prefix_hits_and_priority_tail():
    cfg = SimConfig(rate=600, replicas=6, duration_s=1.5, per_token_s=0.0003, seed=3)
    ours = Simulation(cfg, "ultrafast").run()
    rand = Simulation(cfg, "random").run()
    rr = Simulation(cfg, "round_robin").run()
    assert ours["prefix_hit_rate"] > rand["prefix_hit_rate"]
    assert ours["prefix_hit_rate"] > rr["prefix_hit_rate"]
    assert ours["tiers"]["priority"]["p99_ms"] < rand["tiers"]["priority"]["p99_ms"]
    served = sum(t["served"] + t["refused"] for t in ours["tiers"].values())
    assert served == sum(t["served"] for t in rand["tiers"].values())  # same traffic
    assert (
        sum(ours["routing"]["default"].values())
        == ours["tiers"]["default"]["served"] + (ours["tiers"]["default"]["refused"])
    )


def test_replicas_needed_finds_a_count_that_meets_the_target_and_fewer_do_not():
    cfg = SimConfig(rate=2000, duration_s=1.0, priority_target_s=0.05, seed=1)
    need = replicas_needed(cfg, "ultrafast", [2, 4, 8, 16])
    assert need is not None and need > 1
    assert replicas_needed(cfg, "ultrafast", [need // 2]) is None


def test_plain_serve_never_imports_ray():
    import subprocess
    import sys

    code = (
        "import sys, ultrafast.cli, ultrafast.server.serve, ultrafast.cli_cluster;"
        "ultrafast.cli.build_parser();"
        "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
