"""Tenants and API keys: the `--api-keys` file, key lookup by sha256, and per-tenant token buckets.

File format (YAML or JSON; example in deploy/api-keys.example.yaml):

    tenants:
      - name: acme                      # [A-Za-z0-9_.-]{1,64}; becomes a metrics label
        tiers: [priority, default, flex] # service tiers its keys may use (default: default, flex)
        requests_per_s: 20               # token bucket of requests (0 or absent = unlimited)
        tokens_per_s: 20000              # prompt + max output tokens (0 or absent = unlimited)
        burst_s: 2                       # bucket depth in seconds of rate (default 1)
        committed_priority_share: 0.25   # share of priority seats no other tenant may take
        scopes: [inference]              # inference; metrics (may read /metrics); admin (all)
        disabled: false                  # true: its keys get 403 tenant_disabled
        keys:
          - sha256: <64 hex digits>       # `ultrafast keys hash` prints it; raw keys never stored
            revoked: false                # true: 401 invalid_api_key
            default_tier: flex            # optional: the tier of its calls that name none

Keys are looked up by their sha256 and the stored digest is compared with `hmac.compare_digest`.
A key's `default_tier` (one of the tenant's `tiers`) serves its calls that name no tier: OpenAI
calls without `service_tier`, Anthropic's without one or with `auto`, Ollama's. A key without
one keeps the tenant's behaviour (server/frontends/common.key_tier).
`serve --api-key KEY` (repeatable) is the simple case: its keys belong to one more tenant,
`api-key`, with every tier and scope, beside the file's tenants or alone (`server_api_keys`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from ultrafast.request import ServiceTier

_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
SCOPES = ("inference", "metrics", "admin")
_TENANT_FIELDS = {
    "name",
    "tiers",
    "requests_per_s",
    "tokens_per_s",
    "burst_s",
    "committed_priority_share",
    "scopes",
    "disabled",
    "keys",
}


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return "uf-" + secrets.token_urlsafe(32)


class TokenBucket:
    """`rate_per_s` refill, `capacity` depth. `take` may run into debt by at most one charge
    larger than the capacity (so a request bigger than the bucket can still pass when full)."""

    def __init__(self, rate_per_s: float, capacity: float):
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self.level = capacity
        self._last_s = time.monotonic()

    def _refill(self, now_s: float) -> None:
        self.level = min(self.capacity, self.level + (now_s - self._last_s) * self.rate_per_s)
        self._last_s = now_s

    def take(self, amount: float, now_s: float | None = None) -> float:
        """Takes `amount` and returns 0, or takes nothing and returns seconds until it could."""
        self._refill(time.monotonic() if now_s is None else now_s)
        needed = min(amount, self.capacity)
        if self.level >= needed:
            self.level -= amount
            return 0.0
        return (needed - self.level) / self.rate_per_s

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass
class Tenant:
    name: str
    tiers: frozenset  # ServiceTier members its keys may use
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    burst_s: float = 1.0
    committed_priority_share: float = 0.0
    scopes: frozenset = frozenset({"inference"})
    disabled: bool = False
    request_bucket: TokenBucket | None = field(default=None, repr=False)
    token_bucket: TokenBucket | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.requests_per_s > 0:
            self.request_bucket = TokenBucket(
                self.requests_per_s, max(1.0, self.requests_per_s * self.burst_s)
            )
        if self.tokens_per_s > 0:
            self.token_bucket = TokenBucket(
                self.tokens_per_s, max(1.0, self.tokens_per_s * self.burst_s)
            )

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


ANONYMOUS = Tenant("", tiers=frozenset(ServiceTier), scopes=frozenset(SCOPES))


@dataclass
class ApiKeys:
    tenants: dict  # name -> Tenant
    by_hash: dict  # sha256 hex -> (sha256 hex, Tenant, revoked)
    default_tiers: dict = field(default_factory=dict)  # sha256 hex -> ServiceTier

    def default_tier(self, key: str) -> ServiceTier | None:
        """The tier a key's calls that name none run on, when the keys file gives it one."""
        return self.default_tiers.get(hash_key(key))

    def lookup(self, key: str) -> tuple[Tenant, bool] | None:
        """(tenant, revoked) for a presented key, or None if it is unknown."""
        digest = hash_key(key)
        entry = self.by_hash.get(digest)
        if entry is None:
            return None
        stored, tenant, revoked = entry
        if not hmac.compare_digest(stored, digest):
            return None
        return tenant, revoked

    def priority_seats(self, num_seats: int) -> dict:
        """tenant -> seats of `num_seats` reserved for it (committed capacity, rounded down)."""
        return {
            name: int(math.floor(t.committed_priority_share * num_seats + 1e-9))
            for name, t in self.tenants.items()
            if t.committed_priority_share > 0
        }


def load_api_keys(path: str | Path) -> ApiKeys:
    text = Path(path).read_text()
    try:
        if str(path).endswith(".json"):
            spec = json.loads(text)
        else:
            import yaml

            spec = yaml.safe_load(text)
    except Exception as exc:  # a malformed file must name itself, not dump a parser trace
        raise ValueError(f"{path}: cannot parse ({type(exc).__name__})") from None
    return parse_api_keys(spec, str(path))


def parse_api_keys(spec, source: str = "api keys") -> ApiKeys:
    if not isinstance(spec, dict) or not isinstance(spec.get("tenants"), list):
        raise ValueError(f"{source}: expected a mapping with a `tenants` list")
    tenants, by_hash, default_tiers = {}, {}, {}
    for i, entry in enumerate(spec["tenants"]):
        tenant = _parse_tenant(entry, f"{source}: tenants[{i}]")
        if tenant.name in tenants:
            raise ValueError(f"{source}: tenant {tenant.name!r} is listed twice")
        tenants[tenant.name] = tenant
        for j, key in enumerate(entry.get("keys") or []):
            where = f"{source}: tenants[{i}].keys[{j}]"
            if not isinstance(key, dict) or not _SHA256_HEX.fullmatch(str(key.get("sha256"))):
                raise ValueError(f"{where}: needs `sha256`, 64 lowercase hex digits")
            if key["sha256"] in by_hash:
                raise ValueError(f"{where}: this key already belongs to a tenant")
            by_hash[key["sha256"]] = (key["sha256"], tenant, bool(key.get("revoked", False)))
            if key.get("default_tier") is not None:
                default_tiers[key["sha256"]] = _default_tier(key["default_tier"], tenant, where)
    share = sum(t.committed_priority_share for t in tenants.values())
    if share > 1.0 + 1e-9:
        raise ValueError(f"{source}: committed_priority_share adds up to {share:.2f} (> 1)")
    return ApiKeys(tenants, by_hash, default_tiers)


def _default_tier(name, tenant: Tenant, where: str) -> ServiceTier:
    """A key's `default_tier`: a tier its tenant may use (else the key could call nothing)."""
    if name not in ("priority", "default", "flex"):
        raise ValueError(f"{where}: `default_tier` must be priority, default or flex")
    tier = ServiceTier.parse(name)
    if tier not in tenant.tiers:
        allowed = ", ".join(sorted(t.api_name for t in tenant.tiers))
        raise ValueError(
            f"{where}: `default_tier` {name} is not among the tenant's tiers ({allowed})"
        )
    return tier


def _parse_tenant(entry, where: str) -> Tenant:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping")
    unknown = set(entry) - _TENANT_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    name = entry.get("name")
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise ValueError(f"{where}: `name` must match [A-Za-z0-9_.-]{{1,64}}")
    try:
        tiers = frozenset(ServiceTier.parse(t) for t in entry.get("tiers", ["default", "flex"]))
    except (ValueError, TypeError):
        raise ValueError(f"{where}: `tiers` must list priority, default, flex") from None
    scopes = entry.get("scopes", ["inference"])
    if not isinstance(scopes, list) or not set(scopes) <= set(SCOPES):
        raise ValueError(f"{where}: `scopes` must list some of {list(SCOPES)}")
    numbers: dict[str, float] = {}
    for name_, low, high in (
        ("requests_per_s", 0, 1e9),
        ("tokens_per_s", 0, 1e12),
        ("burst_s", 0.001, 3600),
        ("committed_priority_share", 0, 1),
    ):
        value = entry.get(name_, Tenant.__dataclass_fields__[name_].default)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not low <= value <= high
        ):
            raise ValueError(f"{where}: `{name_}` must be a number in [{low}, {high:g}]")
        numbers[name_] = float(value)
    return Tenant(
        name,
        tiers=tiers,
        scopes=frozenset(scopes),
        disabled=bool(entry.get("disabled", False)),
        requests_per_s=numbers["requests_per_s"],
        tokens_per_s=numbers["tokens_per_s"],
        burst_s=numbers["burst_s"],
        committed_priority_share=numbers["committed_priority_share"],
    )


CLI_TENANT = "api-key"  # the tenant of the keys given with --api-key


def api_key_hashes(keys: list[str]) -> tuple[str, ...]:
    """The sha256 of each `--api-key` value (the raw keys go no further than this);
    ValueError for a key no client could send as `Authorization: Bearer <key>`."""
    for key in keys:
        if not key or any(c.isspace() for c in key) or not key.isprintable():
            raise ValueError("--api-key: a key must be printable, without spaces, not empty")
    return tuple(dict.fromkeys(hash_key(key) for key in keys))


def server_api_keys(path: str | Path | None, key_hashes: tuple[str, ...] = ()) -> ApiKeys | None:
    """The keys a server checks: the --api-keys file's tenants, plus the `api-key` tenant of the
    --api-key hashes; None when neither is given (no auth)."""
    if path is None and not key_hashes:
        return None
    keys = load_api_keys(path) if path is not None else ApiKeys({}, {})
    if not key_hashes:
        return keys
    if CLI_TENANT in keys.tenants:
        raise ValueError(f"{path}: the tenant name {CLI_TENANT!r} is kept for --api-key")
    tenant = Tenant(CLI_TENANT, tiers=frozenset(ServiceTier), scopes=frozenset(SCOPES))
    keys.tenants[CLI_TENANT] = tenant
    for digest in key_hashes:
        if digest in keys.by_hash:
            raise ValueError(f"--api-key: a key given there is also in {path}")
        keys.by_hash[digest] = (digest, tenant, False)
    return keys
