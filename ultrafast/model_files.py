"""Find what a model path offers (HF weights, a GGUF, a tokenizer) and make a GGUF when needed.

Users point us at their own files: an HF directory, a .gguf file, or a directory with both.
Converted GGUFs are cached by source path, size and mtime so the conversion runs once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ultrafast.config import cache_dir


@dataclass(frozen=True)
class ModelFiles:
    name: str  # served model name: the directory or file stem
    hf_dir: Path | None  # config.json + safetensors
    gguf_path: Path | None  # a GGUF next to (or instead of) the HF weights
    tokenizer_dir: Path  # where tokenizer.json lives
    max_position_embeddings: int | None


def resolve_model(model: str | Path) -> ModelFiles:
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is not a model directory or a .gguf file")
        return ModelFiles(path.stem, _hf_dir_or_none(path.parent), path, path.parent,
                          _max_positions(path.parent))
    ggufs = sorted(path.glob("*.gguf"))
    preferred = [g for g in ggufs if "f16" in g.name] or ggufs
    hf_dir = _hf_dir_or_none(path)
    if hf_dir is None and not ggufs:
        raise FileNotFoundError(f"{path} has neither config.json + safetensors nor a .gguf file")
    return ModelFiles(path.name, hf_dir, preferred[0] if preferred else None, path,
                      _max_positions(path))


def _hf_dir_or_none(path: Path) -> Path | None:
    has_weights = any(path.glob("*.safetensors"))
    return path if (path / "config.json").is_file() and has_weights else None


def _max_positions(path: Path) -> int | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")


def gguf_for(files: ModelFiles, outtype: str = "f16") -> Path:
    """The GGUF to run: the one shipped with the model, else a cached conversion of the HF dir."""
    if files.gguf_path is not None:
        return files.gguf_path
    assert files.hf_dir is not None
    stamp = hashlib.sha256()
    for f in sorted(files.hf_dir.iterdir()):
        if f.is_file():
            stat = f.stat()
            stamp.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    out = cache_dir() / "gguf" / f"{files.name}-{stamp.hexdigest()[:12]}-{outtype}.gguf"
    if not out.is_file():
        from ultrafast.convert import convert_hf_to_gguf

        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial")
        convert_hf_to_gguf(files.hf_dir, tmp, outtype=outtype)
        tmp.rename(out)
    return out
