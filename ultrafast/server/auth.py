"""Auth before routing, tier entitlements and per-tenant rate limits (RELIABILITY B41-B49, S9).

`AuthMiddleware` is plain ASGI and answers before the router (in the error shape of the
protocol the path belongs to, server/frontends/), so without a valid key every
path (known or not, any method) is 401 and routes cannot be enumerated; only `GET /health` and
`GET /` (the playground page, which holds no data and asks the user for a key) are open. A
valid key puts its `Tenant` in the ASGI scope; `/metrics` also needs the `metrics` scope.
Without `--api-keys` or `--api-key` every call runs as the anonymous tenant with every tier and
no limits (and the server only listens on loopback).

A key goes in `Authorization: Bearer <key>` or, as Anthropic's clients send it, `x-api-key`.
Failed attempts are logged with the reason and a short digest prefix, never the key; the
`RedactingFilter` scrubs bearer tokens from any log line as a second line of defence.
"""

from __future__ import annotations

import logging
import math
import re
import uuid

from starlette.responses import JSONResponse
from starlette.types import Scope

from ultrafast.request import ServiceTier
from ultrafast.server.errors import APIError
from ultrafast.server.tenants import ANONYMOUS, ApiKeys, Tenant, hash_key

log = logging.getLogger(__name__)

SCOPE_KEY = "ultrafast.tenant"  # where the middleware leaves the caller's Tenant
KEY_TIER = "ultrafast.key_tier"  # and its key's default tier (None: the key names none)
# the playground page holds no data (it asks for a key and sends it with each call)
OPEN_PATHS = {"/health", "/"}
SCOPED_PATHS = {"/metrics": "metrics"}


def tenant_of(scope: Scope) -> Tenant:
    return scope.get(SCOPE_KEY, ANONYMOUS)


def key_default_tier(scope: Scope) -> ServiceTier | None:
    """The `default_tier` the caller's key has in the keys file, or None."""
    return scope.get(KEY_TIER)


def unnamed_tier(scope: Scope, tier: ServiceTier, auto: bool) -> tuple[ServiceTier, bool]:
    """(tier, auto) of a call that named no tier: its key's default tier (not auto), else the
    call's own (what it gets without a keys-file default)."""
    default = key_default_tier(scope)
    return (tier, auto) if default is None else (default, False)


def _bad_key(message: str, code: str) -> APIError:
    return APIError(
        401, message, "authentication_error", code, None, headers={"WWW-Authenticate": "Bearer"}
    )


def authenticate(keys: ApiKeys, scope: dict) -> Tenant:
    """The Tenant behind the request's bearer key, or the 401/403 APIError to send."""
    headers = [v for k, v in scope.get("headers", []) if k == b"authorization"]
    query = scope.get("query_string", b"")
    api_keys = [v for k, v in scope.get("headers", []) if k == b"x-api-key"]
    if not headers and api_keys:  # Anthropic's clients send the key as `x-api-key`
        if len(api_keys) != 1 or not api_keys[0].strip():
            raise _bad_key("invalid API key: expected one `x-api-key` header", "invalid_api_key")
        headers = [b"Bearer " + api_keys[0].strip()]
    if not headers:
        if re.search(rb"(^|&)api[_-]?key=", query):  # keys in URLs end up in logs: refused
            raise _bad_key(
                "send the API key in the Authorization header, not the URL", "invalid_api_key"
            )
        raise _bad_key("missing API key: send `Authorization: Bearer <key>`", "missing_api_key")
    parts = headers[0].decode("latin-1").split(" ")
    if (
        len(headers) != 1
        or len(parts) != 2
        or parts[0].lower() != "bearer"
        or not parts[1]
        or parts[1].lower() == "bearer"
    ):
        raise _bad_key(
            "invalid API key: expected one `Authorization: Bearer <key>` header", "invalid_api_key"
        )
    found = keys.lookup(parts[1])
    if found is None or found[1]:
        log.warning(
            "auth failed (%s key sha256 %s...)",
            "revoked" if found else "unknown",
            hash_key(parts[1])[:8],
        )
        raise _bad_key("invalid API key", "invalid_api_key")
    tenant = found[0]
    scope[KEY_TIER] = keys.default_tier(parts[1])
    if tenant.disabled:
        raise APIError(403, "this tenant is suspended", "permission_error", "tenant_disabled", None)
    need = SCOPED_PATHS.get(scope.get("path", ""))
    if need and not tenant.has_scope(need):
        raise APIError(
            403,
            f"this key may not read {scope['path']}",
            "permission_error",
            "scope_not_allowed",
            None,
        )
    return tenant


def _openai_shape(path: str, error: APIError, request_id: str) -> JSONResponse:
    return JSONResponse(
        error.to_dict(),
        status_code=error.status,
        headers={**error.headers, "x-request-id": request_id},
    )


async def refuse(error: APIError, scope, receive, send, render=_openai_shape) -> None:
    """Answer before the router: the error envelope over HTTP (`render(path, error, id)`
    picks the protocol's shape); a WebSocket handshake is closed with 1008 (policy
    violation) before it is accepted, which the server sends as 403."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
        return
    response = render(scope.get("path", ""), error, uuid.uuid4().hex)
    await response(scope, receive, send)


class AuthMiddleware:
    def __init__(self, app, keys: ApiKeys | None, refused: dict, render=_openai_shape):
        self.app = app
        self.keys = keys
        self.refused = refused  # reason -> count, for metrics
        self.render = render  # (path, APIError, request id) -> the refusal's response

    async def __call__(self, scope, receive, send):
        if (
            self.keys is None
            or scope["type"] not in ("http", "websocket")
            or (scope["path"] in OPEN_PATHS and scope.get("method") in ("GET", "HEAD"))
        ):
            return await self.app(scope, receive, send)
        try:
            scope[SCOPE_KEY] = authenticate(self.keys, scope)
        except APIError as error:
            self.refused[error.code] = self.refused.get(error.code, 0) + 1
            return await refuse(error, scope, receive, send, self.render)
        return await self.app(scope, receive, send)


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


class HostAllowListMiddleware:
    """Refuses a `Host` header outside the allow-list (RELIABILITY S9: a web page that rebinds
    its DNS name to 127.0.0.1 still sends its own name as Host). Empty list: no check."""

    def __init__(self, app, allowed_hosts: tuple = ()):
        self.app = app
        self.allowed = {h.lower() for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if not self.allowed or scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        host = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1").lower()
        name = (
            host[1 : host.index("]")]
            if host.startswith("[") and "]" in host
            else host.rsplit(":", 1)[0]
            if host.count(":") == 1
            else host
        )
        if name in self.allowed:
            return await self.app(scope, receive, send)
        error = APIError(
            403,
            "this Host is not allowed (see --allowed-host)",
            "permission_error",
            "host_not_allowed",
            None,
        )
        return await refuse(error, scope, receive, send)


def allowed_hosts_for(bind_host: str, configured: tuple) -> tuple:
    """The configured list, else the loopback names when bound to loopback, else no check."""
    if configured:
        return tuple(configured)
    return LOOPBACK_NAMES if bind_host in LOOPBACK_NAMES else ()


def entitled_tier(
    tenant: Tenant, tier: ServiceTier, auto: bool, param: str, refused: dict
) -> tuple[ServiceTier, bool]:
    """The tier to serve and whether it is still `auto`; 403 when the tenant may not use it."""
    if auto:
        if ServiceTier.PRIORITY in tenant.tiers:
            return tier, True
        for fallback in (ServiceTier.DEFAULT, ServiceTier.FLEX):
            if fallback in tenant.tiers:
                return fallback, False
    if tier in tenant.tiers:
        return tier, False
    refused["priority_not_allowed"] = refused.get("priority_not_allowed", 0) + 1
    code = "priority_not_allowed" if tier == ServiceTier.PRIORITY else "tier_not_allowed"
    raise APIError(
        403, f"this API key may not use the {tier.api_name} tier", "permission_error", code, param
    )


def _rate_limited(what: str, wait_s: float) -> APIError:
    return APIError(
        429,
        f"rate limit reached for {what}; retry after {math.ceil(wait_s)} s",
        "rate_limit_error",
        "rate_limit_exceeded",
        None,
        headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
    )


def take_request(tenant: Tenant, refused: dict) -> None:
    """One request from the tenant's requests/s bucket, or 429 with Retry-After."""
    if tenant.request_bucket is not None:
        wait_s = tenant.request_bucket.take(1)
        if wait_s:
            refused["rate_limit_requests"] = refused.get("rate_limit_requests", 0) + 1
            raise _rate_limited("requests per second", wait_s)


def take_tokens(tenant: Tenant, num_tokens: int, refused: dict) -> int:
    """Reserve prompt + max output tokens; returns the amount taken (refund the unused part)."""
    if tenant.token_bucket is None:
        return 0
    wait_s = tenant.token_bucket.take(num_tokens)
    if wait_s:
        refused["rate_limit_tokens"] = refused.get("rate_limit_tokens", 0) + 1
        raise _rate_limited("tokens per second", wait_s)
    return num_tokens


class RedactingFilter(logging.Filter):
    """Scrubs bearer tokens and api_key=... from log lines (RELIABILITY S2)."""

    _pattern = re.compile(r"(?i)(bearer\s+|api[_-]?key=)[^\s&'\"]+")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = self._pattern.sub(r"\1[REDACTED]", message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True
