"""Tenant rate limits shared by every replica: the token buckets of server/tenants.py kept in
Redis, so N replicas grant a tenant its limit once, not N times.

`RedisTokenBucket` has TokenBucket's interface (`take`, `give_back`), so the server's
admission code (server/auth.py take_request/take_tokens, calls.py refunds) is unchanged: the
cluster replica swaps each tenant's buckets for shared ones at start (`share_buckets`). One
Lua script refills and takes atomically, on Redis's clock, so replicas' clocks do not matter.

When Redis cannot be reached, `fail` decides (docs/RELIABILITY.md C5):
- "open": each replica falls back to its own in-process bucket (a tenant may get up to N times
  its limit for as long as Redis is away; nobody is refused for the outage);
- "closed": every rate-limited request is refused with 429 and Retry-After 1 until Redis is back.
After a failure Redis is not tried again for `retry_s`, so an outage costs one timeout, not one
per request.
"""

from __future__ import annotations

import logging
import time

from ultrafast.server.tenants import ApiKeys, TokenBucket

log = logging.getLogger(__name__)

FAIL_MODES = ("open", "closed")

# KEYS[1]: the bucket; ARGV: rate/s, capacity, amount, mode (take | give), ttl ms.
# Returns the seconds to wait as a string ("0": taken); Lua numbers would be cut to integers.
_BUCKET_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, capacity = tonumber(ARGV[1]), tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'level', 'last')
local level, last = tonumber(state[1]), tonumber(state[2])
if level == nil then level, last = capacity, now end
level = math.min(capacity, level + math.max(0, now - last) * rate)
local wait = 0
if ARGV[4] == 'give' then
  level = math.min(capacity, level + amount)
else
  local needed = math.min(amount, capacity)
  if level >= needed then level = level - amount else wait = (needed - level) / rate end
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'last', tostring(now))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return tostring(wait)
"""


class SharedLimits:
    """One Redis connection and the outage state for every bucket of this process."""

    def __init__(
        self,
        url: str,
        fail: str = "open",
        prefix: str = "ultrafast:limits:",
        retry_s: float = 1.0,
        ca_file: str | None = None,
    ):
        import redis

        from ultrafast.redis_conn import check_at_start, client_options

        if fail not in FAIL_MODES:
            raise ValueError(f"--limits-fail must be one of {FAIL_MODES}, not {fail!r}")
        self.fail = fail
        self.prefix = prefix
        self.retry_s = retry_s
        # short timeouts: a take runs on the event loop, and an outage must not stall it long
        check_at_start(url, "shared rate limits", ca_file)  # refused credentials: ValueError
        self.client = redis.Redis.from_url(
            url, socket_timeout=0.2, socket_connect_timeout=0.2, **client_options(url, ca_file)
        )
        self._script = self.client.register_script(_BUCKET_SCRIPT)
        self._down_until = 0.0
        self.errors = 0  # Redis calls that failed (for /metrics and the tests)

    def call(
        self, key: str, rate: float, capacity: float, amount: float, mode: str
    ) -> float | None:
        """Seconds to wait (0: taken), or None when Redis is unreachable."""
        if time.monotonic() < self._down_until:
            return None
        import redis

        ttl_ms = int(1000 * max(60.0, 2 * capacity / rate))
        try:
            reply = self._script(
                keys=[self.prefix + key], args=[rate, capacity, amount, mode, ttl_ms]
            )
        except redis.RedisError as exc:
            self.errors += 1
            self._down_until = time.monotonic() + self.retry_s
            log.warning("shared rate limits: Redis unreachable (%s): failing %s", exc, self.fail)
            return None
        return float(reply)


class RedisTokenBucket(TokenBucket):
    """A TokenBucket whose level lives in Redis; the inherited local level is the fail-open
    fallback."""

    def __init__(self, shared: SharedLimits, key: str, rate_per_s: float, capacity: float):
        super().__init__(rate_per_s, capacity)
        self.shared = shared
        self.key = key

    def take(self, amount: float, now_s: float | None = None) -> float:
        wait_s = self.shared.call(self.key, self.rate_per_s, self.capacity, amount, "take")
        if wait_s is not None:
            return wait_s
        if self.shared.fail == "closed":
            return 1.0
        return super().take(amount, now_s)

    def give_back(self, amount: float) -> None:
        done = self.shared.call(self.key, self.rate_per_s, self.capacity, amount, "give")
        if done is None:
            super().give_back(amount)


def share_buckets(keys: ApiKeys, shared: SharedLimits) -> None:
    """Swap every tenant's request and token buckets for Redis-backed ones (same rate, depth)."""
    for tenant in keys.tenants.values():
        for attr in ("request_bucket", "token_bucket"):
            bucket = getattr(tenant, attr)
            if bucket is not None:
                key = f"{tenant.name}:{attr}"
                setattr(
                    tenant, attr, RedisTokenBucket(shared, key, bucket.rate_per_s, bucket.capacity)
                )
