"""The start-cost cache: what was measured about this machine, one JSON file per identity
(CPU, model file, flags) under `$ULTRAFAST_CACHE_DIR/start-costs/`. Used by the engine's
start costs (engine/start_costs.py: thread plan, idle speed) and by the wide path's routing
decision (executors/wide_lazy.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from ultrafast.config import cache_dir

log = logging.getLogger("ultrafast")

CACHE_VERSION = 1


def cache_path(identity: dict, root: Path | None = None) -> Path:
    text = json.dumps({"version": CACHE_VERSION, **identity}, sort_keys=True)
    key = hashlib.sha256(text.encode()).hexdigest()[:32]
    return (cache_dir() if root is None else root) / "start-costs" / f"{key}.json"


def read_cache(identity: dict) -> dict | None:
    """The cached record for this identity, or None (absent, unreadable, not ours)."""
    try:
        data = json.loads(cache_path(identity).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("identity") != json.loads(json.dumps(identity)):
        return None  # a hash collision or an edited file: not ours
    return data


def write_cache(identity: dict, record: dict) -> None:
    """Store `record` for this identity; a failure is logged, never raised."""
    path = cache_path(identity)
    data = {"identity": identity, **record, "measured_at": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)  # a reader sees the old file or the new one, never half
    except OSError as exc:
        log.warning("start costs not cached (%s): the next start measures them again", exc)
