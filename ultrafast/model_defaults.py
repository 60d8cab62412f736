"""A model's own sampling defaults, and the server's flags layered over them.

What a request leaves out is filled, field by field, from (first wins): the server's flags
(`--temperature`, `--top-p`, `--top-k`, `--min-p`, `--repeat-penalty`), the model's defaults,
then the API's (temperature 1, top_p 1, no top_k / min_p / penalty). A model's defaults come
from `generation_config.json` in an HF directory, a GGUF's `general.sampling.*` metadata, and,
for a GGUF, a `<stem>.generation_config.json` beside the file, which wins: the model fetch
writes one with the model card's recommended sampling (a GGUF converted from a card rarely
carries it), and a user may write one for any GGUF.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# the sampling fields a model or the server may default, and their types
SAMPLING_KEYS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
}
SIDECAR_SUFFIX = ".generation_config.json"

# SmolLM2-135M-Instruct's model card: "temperature=0.2, top_p=0.9" (written by model_fetch)
SMOLLM2_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def sidecar_path(gguf: str | Path) -> Path:
    gguf = Path(gguf)
    return gguf.with_name(gguf.stem + SIDECAR_SUFFIX)


def sampling_values(data: object, source: str) -> dict:
    """The sampling fields of a generation_config-shaped object; others are ignored, a
    non-number is skipped with a warning."""
    out: dict = {}
    if not isinstance(data, dict):
        log.warning("%s is not a JSON object; ignored", source)
        return out
    for key, kind in SAMPLING_KEYS.items():
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = kind(value)
        elif value is not None:
            log.warning("%s: %s = %r is not a number; ignored", source, key, value)
    return out


def read_sidecar(gguf: str | Path) -> dict:
    """The sampling defaults in the GGUF's `<stem>.generation_config.json`, {} without one."""
    path = sidecar_path(gguf)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s); ignored", path, exc)
        return {}
    return sampling_values(data, str(path))


def write_sidecar(gguf: str | Path, values: dict) -> Path:
    """Write (atomically) the sampling defaults beside a GGUF."""
    path = sidecar_path(gguf)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    partial.replace(path)
    return path


def merged_defaults(model: dict, flags: tuple[tuple[str, float], ...]) -> tuple:
    """Limits.sampling_defaults: the server's flags over the model's defaults."""
    return tuple(sorted({**model, **dict(flags)}.items()))
