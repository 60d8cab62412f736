"""Shared token buckets in a real redis-server (cluster/shared_limits.py)."""

import uuid

import pytest

from ultrafast.cluster.shared_limits import SharedLimits, share_buckets
from ultrafast.server.tenants import parse_api_keys
from ultrafast_harness.bench.redis_server import RedisServer

KEYS = {
    "tenants": [
        {
            "name": "acme",
            "requests_per_s": 0.001,  # no refill during the test: the depth is all there is
            "burst_s": 3000,  # 3 requests deep
            "keys": [{"sha256": "a" * 64}],
        }
    ]
}


def _replica(url, fail="open", prefix="ultrafast:limits:"):
    """One replica's view: its own parsed keys file, buckets shared through Redis."""
    keys = parse_api_keys(KEYS)
    share_buckets(keys, SharedLimits(url, fail=fail, prefix=prefix))
    return keys.tenants["acme"]


def test_two_replicas_grant_a_tenant_its_limit_once(redis_server):
    prefix = f"t-{uuid.uuid4().hex}:"
    a, b = _replica(redis_server.url, prefix=prefix), _replica(redis_server.url, prefix=prefix)
    granted = [t.request_bucket.take(1) == 0 for t in (a, b, a, b, a, b)]
    assert granted.count(True) == 3  # the bucket is 3 deep, whichever replica asks
    assert a.request_bucket.take(1) > 0 and b.request_bucket.take(1) > 0
    b.request_bucket.give_back(1)  # a refund on one replica frees a request on the other
    assert a.request_bucket.take(1) == 0


def test_redis_down_fails_open_to_a_local_bucket_or_closed_to_a_refusal():
    server = RedisServer()
    try:
        opened = _replica(server.url, fail="open", prefix="o:")
        closed = _replica(server.url, fail="closed", prefix="c:")
    finally:
        server.close()
    assert opened.request_bucket.take(1) == 0  # the local bucket: full
    assert opened.request_bucket.shared.errors == 1
    assert closed.request_bucket.take(1) == 1.0  # refused, retry after 1 s
    taken = [opened.request_bucket.take(1) == 0 for _ in range(4)]
    assert taken == [True, True, False, False]  # the local bucket holds its own limit


def test_a_bad_fail_mode_is_refused():
    with pytest.raises(ValueError, match="limits-fail"):
        SharedLimits("redis://127.0.0.1:1/0", fail="maybe")
