"""Sizes and durations for the model residency cache: byte budgets, Ollama-style keep_alive,
what a model costs in memory, and which idle models to evict to make room.

Pure functions, so the policy is unit-tested without an engine.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ultrafast.model.kv_budget import kv_bytes_per_position
from ultrafast.model_files import ModelFiles

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|h|m|s)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_bytes(text: str) -> int:
    """`2G`, `1.5GiB`, `300M`, `123456` -> bytes. ValueError on anything else."""
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise ValueError(f"not a byte size: {text!r} (e.g. 2G, 512MiB, 1000000)")
    unit = (match.group(2) or "").lower()
    return int(float(match.group(1)) * _UNITS[unit])


def parse_keep_alive(value: object) -> float | None:
    """Ollama's keep_alive as seconds: a number of seconds, or a duration string (`5m`,
    `1h30m`, `90s`, `500ms`); any negative value keeps the model loaded (None = forever);
    0 unloads it as soon as its requests are done. ValueError on anything else."""
    if isinstance(value, bool):
        raise ValueError("keep_alive must be a duration like 5m or a number of seconds")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        negative = text.startswith("-")
        body = text[1:] if negative else text
        try:
            seconds = float(body)
        except ValueError:
            parts = _DURATION_PART.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(
                    f"keep_alive {value[:40]!r} is not a duration (e.g. 5m, 30s, 1h, -1, 0)"
                ) from None
            seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
        seconds = -seconds if negative else seconds
    else:
        raise ValueError("keep_alive must be a duration like 5m or a number of seconds")
    if not math.isfinite(seconds):
        raise ValueError("keep_alive must be finite")
    return None if seconds < 0 else seconds


def weight_bytes(files: ModelFiles) -> int:
    """Bytes of the weights the engine maps: the GGUF when there is one (the CPU executor runs
    it), else the safetensors."""
    if files.gguf_path is not None and files.gguf_path.is_file():
        return files.gguf_path.stat().st_size
    if files.hf_dir is not None:
        return sum(p.stat().st_size for p in Path(files.hf_dir).glob("*.safetensors"))
    return 0


def resident_bytes(files: ModelFiles, num_slots: int, max_model_len: int) -> int:
    """What a loaded model costs: its weights plus its KV pool at f16 (the part that is
    allocated at load, not mapped), the sum the budget is charged."""
    per_position = kv_bytes_per_position(files.gguf_path, files.hf_dir) or 0
    return weight_bytes(files) + per_position * num_slots * max_model_len


@dataclass(frozen=True)
class Candidate:
    """A loaded model that could be evicted: idle (no request in flight) and not pinned."""

    name: str
    num_bytes: int
    last_used_s: float
    next_use_s: float | None = None  # the predictor's guess; None: nothing predicted


def pick_victims(
    candidates: Iterable[Candidate], need_bytes: int, free_bytes: int, before_s: float | None = None
) -> list[str] | None:
    """Least recently used first, the idle models to evict so that `need_bytes` fit into
    `free_bytes` plus what they free; None when even all of them are not enough. With
    `before_s` (a preload), a model predicted to be used before then is kept: evicting it
    to preload another would trade one cold load for another."""
    if need_bytes <= free_bytes:
        return []
    usable = [
        c for c in candidates if before_s is None or c.next_use_s is None or c.next_use_s > before_s
    ]
    victims = []
    for c in sorted(usable, key=lambda c: c.last_used_s):
        victims.append(c.name)
        free_bytes += c.num_bytes
        if need_bytes <= free_bytes:
            return victims
    return None
