"""L2: exported slots in host memory, least recently used first out, within a hard byte budget.

Entries are kept unframed (tenant digest, token ids, payload): they never left this process,
so the engine thread can store one without hashing megabytes; blob.py frames them for L3.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ultrafast.kvcache.tiers import TierStats


@dataclass
class HostEntry:
    tenant: str  # blob.tenant_digest of the owner
    token_ids: list[int]  # the payload holds KV for exactly these positions (or more)
    payload: bytes
    origin: str = "host"  # the tier it came from, until its first restore (metrics' hit tier)

    @property
    def nbytes(self) -> int:
        return len(self.payload) + 4 * len(self.token_ids)


class HostTier:
    name = "host"

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError("the host KV budget must be >= 0")
        self.budget_bytes = budget_bytes
        self.stats = TierStats()
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> HostEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.num_misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.num_gets += 1
            self.stats.bytes_read += entry.nbytes
            return entry

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: str, entry: HostEntry) -> bool:
        if entry.nbytes > self.budget_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.stats.bytes_held -= old.nbytes
            while self._entries and self.stats.bytes_held + entry.nbytes > self.budget_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.stats.bytes_held -= dropped.nbytes
                self.stats.num_evictions += 1
            self._entries[key] = entry
            self.stats.bytes_held += entry.nbytes
            self.stats.num_puts += 1
            self.stats.bytes_written += entry.nbytes
            return True

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.stats.bytes_held -= old.nbytes
