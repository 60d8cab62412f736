"""The contract of a KV store tier (host memory, disk, Redis) and its counters.

Every method is thread-safe and never raises for a store failure: a full disk, a read-only
directory or a Redis outage make `put` return False and `get` return None, count the
failure in `stats` and log it once per outage, so the caller recomputes instead of failing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    num_puts: int = 0
    num_gets: int = 0  # hits
    num_misses: int = 0
    num_evictions: int = 0  # blobs dropped to stay within the byte budget
    num_errors: int = 0  # failed writes/reads (full disk, outage, corrupt entry)
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_held: int = 0
    degraded: bool = False  # the last operation failed: the tier is being skipped


class KVTier(Protocol):
    """A persistent tier (disk, Redis): framed blobs (blob.py) by key."""

    name: str  # "host", "disk", "redis": the metrics' tier label
    stats: TierStats

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, blob: bytes) -> bool: ...

    def contains(self, key: str) -> bool: ...

    def longest(self, keys: list[str]) -> str | None: ...

    def delete(self, key: str) -> None: ...


class FailureLog:
    """Logs the first failure of an outage and the recovery, not every failed call."""

    def __init__(self, name: str, stats: TierStats, retry_after_s: float = 1.0):
        self.name, self.stats, self.retry_after_s = name, stats, retry_after_s
        self._lock = threading.Lock()
        self._down_until = 0.0

    def failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.stats.num_errors += 1
            self._down_until = time.monotonic() + self.retry_after_s
            if not self.stats.degraded:
                log.warning(
                    "KV %s tier: %s failed (%s: %s); turns recompute until it recovers",
                    self.name,
                    what,
                    type(exc).__name__,
                    exc,
                )
            self.stats.degraded = True

    def ok(self) -> None:
        if self.stats.degraded:
            with self._lock:
                if self.stats.degraded:
                    log.warning("KV %s tier recovered", self.name)
                self.stats.degraded = False

    def skipping(self) -> bool:
        """True while a recent failure says not to try yet (no stall on every request)."""
        return self.stats.degraded and time.monotonic() < self._down_until
