"""L3 on disk: one file per blob, written to a temporary name, fsynced, then renamed (a crash
leaves the old blob or the new one, never half of one), within a hard byte budget.

The index (key -> size, last use) is rebuilt from the directory at start, so a restarted
server finds its conversations' KV. Leftover temporary files of a crash are removed then.
Blobs are created 0600 and a directory this tier creates is 0700: conversations' KV is as
private as their text.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

from ultrafast.kvcache.tiers import FailureLog, TierStats

_SUFFIX = ".kv"
_KEY = re.compile(r"^[0-9a-f-]{16,200}$")  # keys are hex digests: no path tricks


def _remove(path: Path) -> None:
    """Unlink, whatever state the directory is in (gone, replaced, read-only)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


class DiskTier:
    name = "disk"

    def __init__(self, directory: str | Path, budget_bytes: int):
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.stats = TierStats()
        self._failures = FailureLog(self.name, self.stats)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        self._scan()

    def _scan(self) -> None:
        entries = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                _remove(path)  # a write that a crash cut short
            elif path.suffix == _SUFFIX and _KEY.match(path.stem):
                st = path.stat()
                entries.append((st.st_mtime_ns, path.stem, st.st_size))
        for _, key, size in sorted(entries):  # oldest first: the LRU order survives restarts
            self._index[key] = size
            self.stats.bytes_held += size
        self._evict_to(self.budget_bytes)

    def _path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"bad KV key {key!r}")
        return self.directory / (key + _SUFFIX)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def longest(self, keys: list[str]) -> str | None:
        """The last of `keys` that the directory holds (from the index: no I/O)."""
        with self._lock:
            return next((key for key in reversed(keys) if key in self._index), None)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            if key not in self._index:
                self.stats.num_misses += 1
                return None
            self._index.move_to_end(key)
        try:
            blob = self._path(key).read_bytes()
        except OSError as exc:
            self._failures.failed("read", exc)
            self.delete(key)
            return None
        self._failures.ok()
        with self._lock:
            self.stats.num_gets += 1
            self.stats.bytes_read += len(blob)
        return blob

    def put(self, key: str, blob: bytes) -> bool:
        if len(blob) > self.budget_bytes or self._failures.skipping():
            return False
        path = self._path(key)
        with self._lock:
            self._evict_to(self.budget_bytes - len(blob), keep=key)
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:  # full disk, read-only directory, quota
            _remove(tmp)
            self._failures.failed("write", exc)
            return False
        self._failures.ok()
        with self._lock:
            self.stats.bytes_held += len(blob) - self._index.pop(key, 0)
            self._index[key] = len(blob)
            self.stats.num_puts += 1
            self.stats.bytes_written += len(blob)
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.stats.bytes_held -= size
        if size is not None:
            _remove(self._path(key))

    def _evict_to(self, limit: int, keep: str | None = None) -> None:
        """Drop least recently used files until the held bytes fit `limit` (lock held)."""
        for key in list(self._index):
            if self.stats.bytes_held <= limit:
                break
            if key == keep:
                continue
            self.stats.bytes_held -= self._index.pop(key)
            self.stats.num_evictions += 1
            _remove(self._path(key))
