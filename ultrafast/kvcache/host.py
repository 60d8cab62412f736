"""L2: exported slots in host memory, least recently used first out, within a hard byte budget.

Entries are kept unframed (tenant digest, token ids, payload): they never left this process,
so the engine thread can store one without hashing megabytes; blob.py frames them for L3.

An entry is stored under the key of its last full block and can also be found under the keys
of its earlier blocks (aliases): a conversation's next prompt re-tokenizes the previous answer,
and when its last block comes out differently the entry still serves every block before it,
instead of an older, shorter entry (or none). An alias points at the newest entry holding its
block and goes with it.
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
        self._aliases: dict[str, str] = {}  # an earlier block's key -> the entry's key
        self._alias_keys: dict[str, list[str]] = {}  # entry key -> its aliases
        self._lock = threading.Lock()

    def _resolve(self, key: str) -> str:
        return key if key in self._entries else self._aliases.get(key, key)

    def get(self, key: str) -> HostEntry | None:
        with self._lock:
            key = self._resolve(key)
            entry = self._entries.get(key)
            if entry is None:
                self.stats.num_misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.num_gets += 1
            self.stats.bytes_read += entry.nbytes
            return entry

    def resolve(self, key: str) -> str:
        """The key of the entry `key` names (itself, or the entry an alias points at)."""
        with self._lock:
            return self._resolve(key)

    def contains(self, key: str) -> bool:
        with self._lock:
            return self._resolve(key) in self._entries

    def put(self, key: str, entry: HostEntry, aliases: list[str] | tuple[str, ...] = ()) -> bool:
        """Store `entry` under `key`, also found under `aliases` (its earlier blocks' keys)."""
        if entry.nbytes > self.budget_bytes:
            return False
        with self._lock:
            self._drop(key)
            while self._entries and self.stats.bytes_held + entry.nbytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))
                self.stats.num_evictions += 1
            self._entries[key] = entry
            for alias in aliases:
                if alias != key and alias not in self._entries:
                    self._aliases[alias] = key
            self._alias_keys[key] = list(aliases)
            self.stats.bytes_held += entry.nbytes
            self.stats.num_puts += 1
            self.stats.bytes_written += entry.nbytes
            return True

    def delete(self, key: str) -> None:
        """Delete the entry `key` names (itself or through an alias)."""
        with self._lock:
            self._drop(self._resolve(key))

    def _drop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.stats.bytes_held -= old.nbytes
        for alias in self._alias_keys.pop(key, ()):
            if self._aliases.get(alias) == key:  # not taken over by a newer entry
                del self._aliases[alias]
