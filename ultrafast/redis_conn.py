"""Connecting to Redis: credentials, TLS, and a start-up check that a wrong password fails loudly.

Every Redis client of the server (the session store, the KV tier, a cluster's shared rate
limits) is made from a URL: `redis://[user:password@]host:port/db`, `rediss://...` for TLS,
or `unix://path`. redis-py reads the user, the password and the database from the URL; this
module adds the CA file of a private certificate authority (`--redis-ca-file`) to TLS
connections, and checks each URL once at start:

- refused credentials (a wrong password, an unknown ACL user, a user without the commands the
  server runs) and a failed TLS handshake are a start-up error naming the store and the URL
  with its password hidden: never a silent fallback to "Redis is down" behaviour;
- an unreachable server is only logged: each user of Redis has its outage handling
  (docs/RELIABILITY.md), and the server may start before Redis does.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

_REFUSED_CREDENTIALS = ("WRONGPASS", "NOAUTH", "NOPERM", "invalid password", "invalid username")
_TLS_WORDS = ("SSL", "TLS", "certificate", "CERTIFICATE")


def client_options(url: str, ca_file: str | None = None) -> dict[str, Any]:
    """Extra keyword arguments of redis-py's `from_url` for this URL: the CA file that verifies
    a `rediss://` server (certificates are always verified)."""
    if not url.startswith("rediss://"):
        return {}
    options: dict[str, Any] = {"ssl_cert_reqs": "required"}
    if ca_file:
        options["ssl_ca_certs"] = ca_file
    return options


def redacted(url: str) -> str:
    """The URL with its password replaced by `***` (for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def check_at_start(url: str, what: str, ca_file: str | None = None) -> None:
    """PING `url` once. ValueError (a clear start-up error) when Redis refuses the credentials
    or the TLS handshake fails; an unreachable server is logged and left to the caller."""
    import redis

    client = redis.Redis.from_url(
        url, socket_timeout=2.0, socket_connect_timeout=2.0, **client_options(url, ca_file)
    )
    try:
        client.ping()
    except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
        raise _refused(what, url, exc) from None
    except redis.ResponseError as exc:
        if any(word in str(exc) for word in _REFUSED_CREDENTIALS):
            raise _refused(what, url, exc) from None
        raise ValueError(f"{what}: Redis at {redacted(url)} answered PING with {exc}") from None
    except (redis.ConnectionError, OSError) as exc:
        if any(word in str(exc) for word in _TLS_WORDS):
            raise ValueError(
                f"{what}: the TLS connection to Redis at {redacted(url)} failed ({exc}); "
                "check the rediss:// URL and --redis-ca-file"
            ) from None
        log.warning("%s: Redis at %s is unreachable at start (%s)", what, redacted(url), exc)
    finally:
        client.close()


def _refused(what: str, url: str, exc: BaseException) -> ValueError:
    return ValueError(
        f"{what}: Redis at {redacted(url)} refused the credentials ({exc}); give them in the "
        "URL as redis://user:password@host:port/db"
    )
