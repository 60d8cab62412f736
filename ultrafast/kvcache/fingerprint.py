"""What a KV blob depends on: a blob made under another fingerprint is never imported.

The KV of a slot is only meaningful to the same weights (file hash), the same cache element
type, the same attention layout (flash attention stores V untransposed), the same executor
and the same framing of ours (LAYOUT_VERSION). The fingerprint is a short hex digest of them.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

LAYOUT_VERSION = 1  # bump when blob.py or an executor's payload layout changes

_hash_lock = threading.Lock()
_file_hashes: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """sha256 of a model file, computed once per (path, size, mtime) in this process."""
    path = os.path.realpath(path)
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    with _hash_lock:
        cached = _file_hashes.get(key)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    value = digest.hexdigest()
    with _hash_lock:
        _file_hashes[key] = value
    return value


def kv_fingerprint(**parts: object) -> str:
    """A stable digest of the named parts (model hash, kv dtype, flash attention, executor...)."""
    parts = {**parts, "layout_version": LAYOUT_VERSION}
    text = ";".join(f"{name}={parts[name]}" for name in sorted(parts))
    return hashlib.sha256(text.encode()).hexdigest()[:32]
