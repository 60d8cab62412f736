"""Tenants and keys (docs/RELIABILITY.md B41, B45-B47, S2): keys file parsing, the auth decision
for each bad credential, tier entitlements, token buckets, and committed priority capacity at
admission and in the scheduler. The same rows run against the real server in tests/e2e/test_auth.py.
"""

import asyncio
import logging

import pytest

from ultrafast.config import ServerConfig, TierTargets
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.executors.fake_exec import FakeExecutor
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.server.admission import Admission
from ultrafast.server.auth import (
    HostAllowListMiddleware,
    RedactingFilter,
    allowed_hosts_for,
    authenticate,
    entitled_tier,
    take_request,
    take_tokens,
)
from ultrafast.server.errors import APIError
from ultrafast.server.tenants import TokenBucket, hash_key, parse_api_keys

KEYS = {
    "acme": "acme-secret-1",
    "beta": "beta-secret-1",
    "off": "off-secret-1",
    "old": "old-secret-1",
    "ops": "ops-secret-1",
}


def keys_spec():
    return {
        "tenants": [
            {
                "name": "acme",
                "tiers": ["priority", "default"],
                "committed_priority_share": 0.5,
                "keys": [
                    {"sha256": hash_key(KEYS["acme"])},
                    {"sha256": hash_key(KEYS["old"]), "revoked": True},
                ],
            },
            {
                "name": "beta",
                "requests_per_s": 2,
                "tokens_per_s": 100,
                "keys": [{"sha256": hash_key(KEYS["beta"])}],
            },
            {"name": "off", "disabled": True, "keys": [{"sha256": hash_key(KEYS["off"])}]},
            {"name": "ops", "scopes": ["metrics"], "keys": [{"sha256": hash_key(KEYS["ops"])}]},
        ]
    }


def scope(*auth: str, path="/v1/chat/completions", query=b""):
    return {
        "type": "http",
        "path": path,
        "method": "POST",
        "query_string": query,
        "headers": [(b"authorization", a.encode()) for a in auth],
    }


def refusal(keys, s):
    with pytest.raises(APIError) as info:
        authenticate(keys, s)
    e = info.value
    assert set(e.to_dict()["error"]) == {"message", "type", "param", "code"}
    for key in KEYS.values():
        assert key not in e.message
    return e.status, e.type, e.code


AUTH_CASES = {
    "B45 no Authorization": (scope(), (401, "authentication_error", "missing_api_key")),
    "B46 wrong key": (scope("Bearer nope"), (401, "authentication_error", "invalid_api_key")),
    "B46 Bearer twice": (
        scope(f"Bearer Bearer {KEYS['acme']}"),
        (401, "authentication_error", "invalid_api_key"),
    ),
    "B46 two headers": (
        scope(f"Bearer {KEYS['acme']}", f"Bearer {KEYS['acme']}"),
        (401, "authentication_error", "invalid_api_key"),
    ),
    "B46 Basic": (
        scope("Basic YWNtZTpzZWNyZXQ="),
        (401, "authentication_error", "invalid_api_key"),
    ),
    "B46 key in URL": (
        scope(query=f"api_key={KEYS['acme']}".encode()),
        (401, "authentication_error", "invalid_api_key"),
    ),
    "B46 revoked": (
        scope(f"Bearer {KEYS['old']}"),
        (401, "authentication_error", "invalid_api_key"),
    ),
    "B46 empty token": (scope("Bearer "), (401, "authentication_error", "invalid_api_key")),
    "B47 suspended": (scope(f"Bearer {KEYS['off']}"), (403, "permission_error", "tenant_disabled")),
    "metrics scope": (
        scope(f"Bearer {KEYS['acme']}", path="/metrics"),
        (403, "permission_error", "scope_not_allowed"),
    ),
}


@pytest.mark.parametrize("case", AUTH_CASES)
def test_auth_refusals(case):
    s, expected = AUTH_CASES[case]
    assert refusal(parse_api_keys(keys_spec()), s) == expected


def test_valid_keys_map_to_their_tenant():
    keys = parse_api_keys(keys_spec())
    assert authenticate(keys, scope(f"Bearer {KEYS['acme']}")).name == "acme"
    assert authenticate(keys, scope(f"bearer {KEYS['beta']}")).name == "beta"
    assert authenticate(keys, scope(f"Bearer {KEYS['ops']}", path="/metrics")).name == "ops"


def test_keys_are_stored_only_as_digests():
    keys = parse_api_keys(keys_spec())
    assert set(keys.by_hash) == {hash_key(k) for k in KEYS.values()}
    assert not any(k in repr(keys.by_hash) for k in KEYS.values())


BAD_FILES = {
    "no tenants": {},
    "bad name": {"tenants": [{"name": "a b"}]},
    "label-unsafe name": {"tenants": [{"name": "x" * 65}]},
    "unknown field": {"tenants": [{"name": "a", "prio": 1}]},
    "bad tier": {"tenants": [{"name": "a", "tiers": ["warp9"]}]},
    "raw key": {"tenants": [{"name": "a", "keys": [{"sha256": "my-secret"}]}]},
    "shares over 1": {
        "tenants": [
            {"name": "a", "committed_priority_share": 0.7},
            {"name": "b", "committed_priority_share": 0.7},
        ]
    },
    "negative rate": {"tenants": [{"name": "a", "requests_per_s": -1}]},
    "bool rate": {"tenants": [{"name": "a", "tokens_per_s": True}]},
    "duplicate key": {
        "tenants": [
            {"name": "a", "keys": [{"sha256": "0" * 64}]},
            {"name": "b", "keys": [{"sha256": "0" * 64}]},
        ]
    },
    "bad scope": {"tenants": [{"name": "a", "scopes": ["root"]}]},
    "unknown default tier": {
        "tenants": [{"name": "a", "keys": [{"sha256": "0" * 64, "default_tier": "gold"}]}]
    },
    "auto as a default tier": {
        "tenants": [{"name": "a", "keys": [{"sha256": "0" * 64, "default_tier": "auto"}]}]
    },
    "default tier the tenant may not use": {
        "tenants": [{"name": "a", "keys": [{"sha256": "0" * 64, "default_tier": "priority"}]}]
    },
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_keys_files_are_refused_with_a_clear_error(case):
    with pytest.raises(ValueError):
        parse_api_keys(BAD_FILES[case])


def test_b41_priority_without_entitlement():
    keys = parse_api_keys(keys_spec())
    beta, acme = keys.tenants["beta"], keys.tenants["acme"]
    refused = {}
    with pytest.raises(APIError) as info:
        entitled_tier(beta, ServiceTier.PRIORITY, False, "priority", refused)
    e = info.value
    assert (e.status, e.type, e.code, e.param) == (
        403,
        "permission_error",
        "priority_not_allowed",
        "priority",
    )
    assert refused == {"priority_not_allowed": 1}
    # auto quietly becomes default for a tenant without priority; acme keeps auto
    assert entitled_tier(beta, ServiceTier.DEFAULT, True, "service_tier", {}) == (
        ServiceTier.DEFAULT,
        False,
    )
    assert entitled_tier(acme, ServiceTier.DEFAULT, True, "service_tier", {}) == (
        ServiceTier.DEFAULT,
        True,
    )
    with pytest.raises(APIError) as info:
        entitled_tier(acme, ServiceTier.FLEX, False, "service_tier", {})
    assert info.value.code == "tier_not_allowed"


def test_token_bucket_refill_debt_and_retry_after():
    bucket = TokenBucket(rate_per_s=10, capacity=20)
    assert bucket.take(15, now_s=bucket._last_s) == 0
    wait_s = bucket.take(10, now_s=bucket._last_s)
    assert wait_s == pytest.approx(0.5)  # 5 left, 10 needed at 10/s
    assert bucket.take(10, now_s=bucket._last_s + 0.5) == 0
    # bigger than the bucket: allowed when full, then in debt
    big = TokenBucket(rate_per_s=10, capacity=20)
    assert big.take(50, now_s=big._last_s) == 0
    assert big.level == -30
    assert big.take(1, now_s=big._last_s) == pytest.approx(3.1)


def test_rate_limits_answer_429_with_retry_after():
    tenant = parse_api_keys(keys_spec()).tenants["beta"]  # 2 requests/s, burst 2
    refused = {}
    take_request(tenant, refused)
    take_request(tenant, refused)
    with pytest.raises(APIError) as info:
        take_request(tenant, refused)
    e = info.value
    assert (e.status, e.type, e.code) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert int(e.headers["Retry-After"]) >= 1
    assert take_tokens(tenant, 80, refused) == 80
    with pytest.raises(APIError) as info:
        take_tokens(tenant, 80, refused)
    assert info.value.status == 429 and int(info.value.headers["Retry-After"]) >= 1
    assert refused == {"rate_limit_requests": 1, "rate_limit_tokens": 1}


def test_committed_priority_seats_at_admission():
    config = ServerConfig(priority=TierTargets(ttft_ms=1e6, itl_ms=0, max_in_flight=4))
    admission = Admission(config)
    admission.priority_reserved = parse_api_keys(keys_spec()).priority_seats(4)
    assert admission.priority_reserved == {"acme": 2}
    others = [admission.reserve(ServiceTier.PRIORITY, tenant="beta") for _ in range(2)]
    with pytest.raises(APIError) as info:  # the two left are acme's
        admission.reserve(ServiceTier.PRIORITY, tenant="beta")
    assert info.value.code == "queue_full"
    assert (
        admission.reserve(ServiceTier.PRIORITY, auto=True, tenant="beta").tier
        == ServiceTier.DEFAULT
    )
    acme = [admission.reserve(ServiceTier.PRIORITY, tenant="acme") for _ in range(2)]
    with pytest.raises(APIError):
        admission.reserve(ServiceTier.PRIORITY, tenant="acme")
    admission.release(others[0])  # a shared seat frees: anyone may take it
    acme.append(admission.reserve(ServiceTier.PRIORITY, tenant="acme"))
    assert admission.in_flight[ServiceTier.PRIORITY] == 4
    for ticket in others[1:] + acme:
        admission.release(ticket)
    assert admission.in_flight[ServiceTier.PRIORITY] == 0
    assert all(n == 0 for n in admission.priority_by_tenant.values())


def test_committed_priority_seats_in_the_scheduler():
    engine = EngineCore(
        FakeExecutor(num_slots=4), SchedulerConfig(max_num_seqs=4, max_model_len=256)
    )
    engine.scheduler.set_reserved_priority_seats({"acme": 2})
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    def priority(i, tenant):
        return Request(
            f"{tenant}-{i}", [1, 2, 3, i], params, tier=ServiceTier.PRIORITY, tenant=tenant
        )

    for i in range(4):
        engine.add_request(priority(i, "beta"))
    engine.add_request(priority(0, "acme"))
    engine.step()
    running = sorted(r.request_id for r in engine.scheduler.running)
    assert running == ["acme-0", "beta-0", "beta-1"]  # beta may not take acme's 2nd seat
    engine.add_request(priority(1, "acme"))
    engine.step()
    assert "acme-1" in {r.request_id for r in engine.scheduler.running}
    assert len(engine.scheduler.running) == 4


def test_blocked_priority_requests_preempt_nothing():
    """A priority request waiting only for another tenant's committed seats must not preempt
    a default request: it could not take the freed slot anyway (that would thrash)."""
    engine = EngineCore(
        FakeExecutor(num_slots=3), SchedulerConfig(max_num_seqs=3, max_model_len=256)
    )
    engine.scheduler.set_reserved_priority_seats({"acme": 2})
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        engine.add_request(Request(f"default-{i}", [5, 6, i], params, tier=ServiceTier.DEFAULT))
    engine.step()
    for i in range(2):
        engine.add_request(
            Request(f"beta-{i}", [1, 2, i], params, tier=ServiceTier.PRIORITY, tenant="beta")
        )
    for _ in range(5):
        engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    # beta-0 takes the one shared seat (preempting one default request); beta-1 would need one
    # of acme's two unused seats, so it waits and preempts nothing
    assert "beta-0" in running and "beta-1" not in running and len(running) == 3
    assert engine.scheduler.num_preemptions == 1


def test_redacting_filter_scrubs_bearer_tokens(caplog):
    logger = logging.getLogger("ultrafast.test_redact")
    logger.addFilter(RedactingFilter())
    with caplog.at_level(logging.INFO, logger="ultrafast.test_redact"):
        logger.info("headers: Authorization: Bearer %s", KEYS["acme"])
        logger.info("url /v1/models?api_key=%s&x=1", KEYS["beta"])
    assert KEYS["acme"] not in caplog.text and KEYS["beta"] not in caplog.text
    assert caplog.text.count("[REDACTED]") == 2


@pytest.mark.parametrize(
    "host,allowed",
    [
        (b"127.0.0.1:8000", True),
        (b"localhost", True),
        (b"[::1]:8000", True),
        (b"LOCALHOST:1", True),
        (b"evil.example", False),
        (b"evil.example:8000", False),
        (b"127.0.0.1.evil.example", False),
        (b"", False),
    ],
)
def test_s9_host_allow_list(host, allowed):
    seen = []

    async def app(scope, receive, send):
        seen.append(scope)

    sent = []

    async def send(message):
        sent.append(message)

    middleware = HostAllowListMiddleware(app, allowed_hosts_for("127.0.0.1", ()))
    headers = [(b"host", host)] if host else []
    asyncio.run(
        middleware(
            {"type": "http", "path": "/health", "method": "GET", "headers": headers}, None, send
        )
    )
    assert bool(seen) == allowed
    if not allowed:
        assert sent[0]["status"] == 403
    assert allowed_hosts_for("0.0.0.0", ()) == ()  # bound publicly: names are the operator's
    assert allowed_hosts_for("0.0.0.0", ("api.example",)) == ("api.example",)


def test_a_keys_default_tier_reaches_the_scope_and_the_unnamed_tier():
    from ultrafast.server.auth import key_default_tier, unnamed_tier
    from ultrafast.server.frontends.common import key_tier

    spec = keys_spec()
    spec["tenants"][0]["keys"].append({"sha256": hash_key("acme-flex"), "default_tier": "default"})
    spec["tenants"][1]["keys"].append({"sha256": hash_key("beta-flex"), "default_tier": "flex"})
    keys = parse_api_keys(spec)
    with pytest.raises(ValueError, match=r"keys\[1\]: `default_tier` priority is not among"):
        spec["tenants"][1]["keys"][1]["default_tier"] = "priority"
        parse_api_keys(spec)
    for key, tier in (("acme-flex", ServiceTier.DEFAULT), ("beta-flex", ServiceTier.FLEX)):
        s = scope(f"Bearer {key}")
        authenticate(keys, s)
        assert key_default_tier(s) == tier == key_tier(s)
        # a call naming no tier (even one that was "auto") runs on it, not auto
        assert unnamed_tier(s, ServiceTier.PRIORITY, True) == (tier, False)
    plain = scope(f"Bearer {KEYS['beta']}")  # no default_tier: today's behaviour
    authenticate(keys, plain)
    assert key_default_tier(plain) is None
    assert unnamed_tier(plain, ServiceTier.DEFAULT, True) == (ServiceTier.DEFAULT, True)
    assert key_tier(plain) == ServiceTier.DEFAULT
