"""Does the KV cache the ggml executor is about to allocate fit in this machine's memory?

The context a model declares (a GGUF's `<arch>.context_length`, config.json's
max_position_embeddings) only caps what is used: each KV slot holds min(--max-model-len, declared)
positions. A user who raises --max-model-len towards a 128k or 1M declared context can ask for
more KV than the machine has; llama.cpp then fails deep inside context creation. This check
says so first, in numbers, with what to lower.
"""

from __future__ import annotations

import json
from pathlib import Path

from ultrafast.model.config import ModelLoadError
from ultrafast.model.gguf_meta import read_gguf_metadata

_F16_BYTES = 2  # the ggml executor's default KV cache type


def _first_int(value) -> int | None:
    if isinstance(value, list):  # per-layer arrays in some GGUFs: the largest layer counts
        value = max((v for v in value if isinstance(v, int)), default=None)
    return value if isinstance(value, int) and value > 0 else None


def _per_layer(value, layers: int) -> list[int] | None:
    """A generic `<arch>.*` value as one int per layer: a scalar repeats, an array (hybrid and
    variable-width models: 0 heads on a layer without attention) is taken as written."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * layers
    if isinstance(value, list) and len(value) == layers and all(isinstance(v, int) for v in value):
        return list(value)
    return None


def _gguf_bytes_per_position(gguf_path: Path) -> int | None:
    """From the generic keys every llama.cpp architecture writes (block_count,
    attention.head_count[_kv], attention.key_length / value_length, embedding_length), so any
    architecture is sized the same way; MLA models declare their compressed widths there too."""
    meta = read_gguf_metadata(gguf_path)
    layers = _first_int(meta.arch_value("block_count"))
    if not layers:
        return None
    heads = _per_layer(meta.arch_value("attention.head_count"), layers)
    kv_heads = _per_layer(meta.arch_value("attention.head_count_kv"), layers) or heads
    width = _first_int(meta.arch_value("embedding_length"))
    head_dim = width // max(heads) if width and heads and max(heads) > 0 else None
    k_len = _first_int(meta.arch_value("attention.key_length")) or head_dim
    v_len = _first_int(meta.arch_value("attention.value_length")) or head_dim
    if not (kv_heads and k_len and v_len):
        return None
    return sum(kv_heads) * (k_len + v_len) * _F16_BYTES


def kv_bytes_per_position(gguf_path: Path | None, hf_dir: Path | None) -> int | None:
    """K and V bytes one position costs across all layers, or None when the files do not say."""
    if gguf_path is not None:
        return _gguf_bytes_per_position(gguf_path)
    if hf_dir is None:
        return None
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    layers = _first_int(config.get("num_hidden_layers"))
    heads = _first_int(config.get("num_attention_heads"))
    kv_heads = _first_int(config.get("num_key_value_heads")) or heads
    width = _first_int(config.get("hidden_size"))
    k_len = v_len = _first_int(config.get("head_dim")) or (
        width // heads if width and heads else None
    )
    if not (layers and kv_heads and k_len and v_len):
        return None
    return layers * kv_heads * (k_len + v_len) * _F16_BYTES


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_kv_fits(
    gguf_path: Path | None,
    hf_dir: Path | None,
    num_slots: int,
    max_model_len: int,
    declared: int | None,
    available: int | None = None,
) -> None:
    """ModelLoadError when num_slots x max_model_len positions of KV exceed available memory."""
    per_position = kv_bytes_per_position(gguf_path, hf_dir)
    available = available_memory_bytes() if available is None else available
    if per_position is None or available is None:
        return
    need = per_position * num_slots * max_model_len
    if need <= available:
        return
    gib = 1024**3
    fit = max(0, available // (per_position * num_slots))
    declared_text = f" (the model declares {declared:,})" if declared else ""
    raise ModelLoadError(
        f"the KV cache for {num_slots} slots x {max_model_len:,} positions{declared_text} needs "
        f"{need / gib:.1f} GiB but {available / gib:.1f} GiB of memory is available; lower "
        f"--max-model-len (about {fit:,} fits with {num_slots} slots) or --num-slots"
    )


# `--num-slots` auto: the KV of every slot may take this share of the memory free at start...
AUTO_KV_MEMORY_FRACTION = 1 / 16
AUTO_MIN_SLOTS = 8  # ...but never fewer slots than the old fixed default,
# and never more than this: past it a CPU step of that many sequences is so long that more
# concurrency only lengthens every stream's token gaps; further requests wait in the scheduler
AUTO_MAX_SLOTS = 64
AUTO_UNSIZED_SLOTS = 8  # when the files or the machine do not tell the sizes


def auto_num_slots(
    per_position: int | None, max_model_len: int, available: int | None
) -> tuple[int, str]:
    """How many KV slots `--num-slots auto` allocates, and why (one line for the start log).

    Each slot is a KV stream of max_model_len positions allocated (and zeroed) up front, so
    the count is what a share of free memory holds, clamped to [AUTO_MIN_SLOTS, AUTO_MAX_SLOTS].
    """
    if not per_position or not available:
        return AUTO_UNSIZED_SLOTS, "model or machine memory unknown: the fixed default"
    per_slot = per_position * max_model_len
    budget = int(available * AUTO_KV_MEMORY_FRACTION)
    n = max(AUTO_MIN_SLOTS, min(AUTO_MAX_SLOTS, budget // per_slot))
    mib = 1024**2
    return n, (
        f"{n} slots x {per_slot / mib:.1f} MiB of KV ({max_model_len} positions each) = "
        f"{n * per_slot / mib:.0f} MiB; 1/{round(1 / AUTO_KV_MEMORY_FRACTION)} of "
        f"{available / mib:.0f} MiB free, within [{AUTO_MIN_SLOTS}, {AUTO_MAX_SLOTS}]"
    )
