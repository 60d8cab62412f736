"""Find what a model path offers (HF weights, a GGUF, a tokenizer) and make a GGUF when needed.

Users point us at their own files: an HF directory, a .gguf file, or a directory with both.
A .gguf file alone is enough: its metadata holds the tokenizer and the context length.
Converted GGUFs are cached by source path, size and mtime so the conversion runs once.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ultrafast.chat_templates import resolve_chat_template
from ultrafast.config import cache_dir
from ultrafast.model.config import ModelLoadError
from ultrafast.model.gguf_meta import read_gguf_metadata
from ultrafast.model_defaults import read_sidecar
from ultrafast.tokenizer import Tokenizer
from ultrafast.weight_format import resolve_outtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFiles:
    name: str  # served model name: the directory or file stem
    hf_dir: Path | None  # config.json + safetensors
    gguf_path: Path | None  # a GGUF next to (or instead of) the HF weights
    tokenizer_dir: Path  # where tokenizer.json lives (or would)
    max_position_embeddings: int | None  # the model's declared context
    tokenizer_gguf: Path | None = None  # set: the tokenizer comes from this GGUF's metadata
    gguf_named: bool = False  # the user named the .gguf file itself: every executor runs it


def resolve_model(model: str | Path) -> ModelFiles:
    """What `model` offers. A .gguf file is self-contained: its tokenizer, special tokens, chat
    template and context come from its metadata. A directory uses its tokenizer.json (the HF
    layout any GGUF in it was made from), else its GGUF's metadata."""
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is not a model directory or a .gguf file")
        meta = read_gguf_metadata(path)
        return ModelFiles(
            path.stem,
            _hf_dir_or_none(path.parent),
            path,
            path.parent,
            _gguf_context(meta),
            tokenizer_gguf=path,
            gguf_named=True,
        )
    ggufs = sorted(path.glob("*.gguf"))
    preferred = [g for g in ggufs if "f16" in g.name] or ggufs
    hf_dir = _hf_dir_or_none(path)
    if hf_dir is None and not ggufs:
        raise FileNotFoundError(f"{path} has neither config.json + safetensors nor a .gguf file")
    gguf_path = preferred[0] if preferred else None
    tokenizer_gguf = None
    max_positions = _max_positions(path)
    if gguf_path is not None and not (path / "tokenizer.json").is_file():
        tokenizer_gguf = gguf_path
        if max_positions is None:
            max_positions = _gguf_context(read_gguf_metadata(gguf_path))
    return ModelFiles(
        path.name, hf_dir, gguf_path, path, max_positions, tokenizer_gguf=tokenizer_gguf
    )


def _hf_dir_or_none(path: Path) -> Path | None:
    has_weights = any(path.glob("*.safetensors"))
    return path if (path / "config.json").is_file() and has_weights else None


def _max_positions(path: Path) -> int | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{config} is not a valid JSON object: {exc}") from None
    return value if isinstance(value, int) and value > 0 else None


def _gguf_context(meta) -> int | None:
    value = meta.arch_value("context_length")
    return value if isinstance(value, int) and value > 0 else None


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def load_tokenizer(files: ModelFiles, chat_template: str | None = None) -> Tokenizer:
    """The served tokenizer, with `--chat-template` (a built-in name or a Jinja file) over the
    model's own template and a GGUF's sampling sidecar over its metadata (model_defaults.py)."""
    tokenizer = _load_tokenizer(files)
    if files.gguf_path is not None:
        tokenizer.generation_defaults.update(read_sidecar(files.gguf_path))
    if chat_template:
        template = resolve_chat_template(chat_template)
        tokenizer.use_chat_template(template.text, template.end_of_turn)
        _log_once(f"chat template: {template.source}")
    return tokenizer


def _load_tokenizer(files: ModelFiles) -> Tokenizer:
    """The served tokenizer. For a GGUF's own metadata beside a tokenizer.json, the metadata
    wins: it is the vocabulary the weights were made with and gives llama.cpp's ids token for
    token, while a tokenizer.json in the same folder may belong to another file. The
    tokenizer.json is used only when the metadata's tokenizer cannot be reproduced."""
    if files.tokenizer_gguf is None:
        tokenizer = Tokenizer.from_dir(files.tokenizer_dir)
        _log_once(f"tokenizer: {files.tokenizer_dir / 'tokenizer.json'}")
        return tokenizer
    beside = files.tokenizer_dir / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_gguf(files.tokenizer_gguf)
    except ModelLoadError as exc:
        if not beside.is_file():
            raise
        _log_once(f"tokenizer: {exc}; using {beside} instead")
        return Tokenizer.from_dir(files.tokenizer_dir)
    ignored = f"; {beside} is ignored (the GGUF's own vocabulary wins)" if beside.is_file() else ""
    _log_once(f"tokenizer: the metadata of {files.tokenizer_gguf}{ignored}")
    return tokenizer


def tokenizer_fingerprint(files: ModelFiles) -> str:
    """Equal for two models whose vocabularies (tokens in id order and merges) are equal,
    whether they come from a tokenizer.json or a GGUF: the draft-model check."""
    if files.tokenizer_gguf is not None:
        meta = read_gguf_metadata(files.tokenizer_gguf)
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        merges = list(meta.get("tokenizer.ggml.merges") or [])
    else:
        path = files.tokenizer_dir / "tokenizer.json"
        if not path.is_file():
            return f"missing:{path}"
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data.get("model") or {}
        vocab = dict(model.get("vocab") or {})
        vocab.update({t["content"]: t["id"] for t in data.get("added_tokens") or []})
        tokens = [text for text, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    while tokens and tokens[-1].startswith("[PAD"):  # convert pads the vocab to the model's size
        tokens.pop()
    digest = hashlib.sha256(
        json.dumps([tokens, merges], ensure_ascii=False).encode("utf-8", "surrogatepass")
    )
    return digest.hexdigest()


def gguf_for(files: ModelFiles, outtype: str = "f16") -> Path:
    """The GGUF to run: the one shipped with the model, else a cached conversion of the HF dir
    (outtype "auto": the per-CPU rule of ultrafast/weight_format.py, logged)."""
    if files.gguf_path is not None:
        read_gguf_metadata(files.gguf_path)  # a truncated or corrupt file: a clear error now
        return files.gguf_path
    assert files.hf_dir is not None
    outtype, why = resolve_outtype(outtype)
    _log_once(f"weights: {files.hf_dir} runs as a {outtype} GGUF ({why})")
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
