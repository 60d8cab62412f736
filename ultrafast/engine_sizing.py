"""What an engine is built from, before anything heavy is imported: the model's files, the
config sized for them (context length clamped to the model's, the automatic KV slot count)
and the ggml executor's constructor arguments.

`llm.build_engine` sizes through here, and so does `serve`'s early open of the llama.cpp model
(early_open.py), which must ask for exactly what the executor will ask for: both take
the arguments from `ggml_executor_args`. Importing this module does not import torch.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from ultrafast.config import EngineConfig
from ultrafast.model.kv_budget import (
    auto_num_slots,
    available_memory_bytes,
    check_kv_fits,
    kv_bytes_per_position,
)
from ultrafast.model_files import ModelFiles, gguf_for, resolve_model

log = logging.getLogger("ultrafast.llm")

# device nodes a CUDA (or ROCm) device needs: without any, torch sees no GPU
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_possible() -> bool:
    """Whether `torch.cuda.is_available()` could be true here, without importing torch."""
    return any(Path(node).exists() for node in GPU_DEVICE_NODES)


def executor_kind(config: EngineConfig) -> str:
    """ggml, torch or fake; `auto` is torch where CUDA is available."""
    if config.executor != "auto":
        return config.executor
    if not gpu_possible():
        return "ggml"
    import torch

    return "torch" if torch.cuda.is_available() else "ggml"


def embedding_pooling(model: str) -> str | None:
    """The pooling a model file declares ("mean", "cls", "last"): an embedding model. None for
    a chat model or an HF directory (embedding models are served from GGUF files)."""
    path = Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        return None
    from ultrafast.executors.ggml_embed import gguf_pooling

    return gguf_pooling(str(path))


def with_capacity(config: EngineConfig, files: ModelFiles) -> EngineConfig:
    """`num_slots` 0 (auto) sized from free memory for the ggml executor (its per-slot KV is
    host memory); the torch and fake executors keep the fixed default. `max_num_seqs` 0 =
    every slot may run."""
    num_slots = config.num_slots
    if not num_slots:
        per_position = None
        if executor_kind(config) == "ggml":
            per_position = kv_bytes_per_position(gguf_for(files, config.gguf_type), None)
        num_slots, why = auto_num_slots(
            per_position, config.max_model_len, available_memory_bytes()
        )
        log.info("KV slots (auto): %s", why)
    return replace(config, num_slots=num_slots, max_num_seqs=config.max_num_seqs or num_slots)


def sized(config: EngineConfig) -> tuple[EngineConfig, ModelFiles]:
    """The model's files and the config sized for them."""
    files = resolve_model(config.model)
    if files.max_position_embeddings:
        config = replace(
            config, max_model_len=min(config.max_model_len, files.max_position_embeddings)
        )
    return with_capacity(config, files), files


def llama_weights(config: EngineConfig, gguf_path: Path) -> Path:
    """The file llama.cpp loads: a bf16 GGUF's exact float16 copy where that is checked and
    measured faster here (executors/f16_twin.py), else the file itself."""
    from ultrafast.executors.f16_twin import choose_weights
    from ultrafast.executors.ggml_open import physical_cores

    threads = config.n_threads_batch or config.n_threads or physical_cores()
    width = min(config.num_slots, 16)
    return choose_weights(gguf_path, width, threads, config.flash_attn, config.f16_twin).weights


def ggml_executor_args(config: EngineConfig, files: ModelFiles) -> tuple[Path, dict[str, Any]]:
    """The GGUF file and `GgmlExecutor`'s keyword arguments for a sized config; a KV cache that
    cannot fit is a clear error here, before llama.cpp's."""
    gguf_path = gguf_for(files, config.gguf_type)
    check_kv_fits(
        gguf_path, None, config.num_slots, config.max_model_len, files.max_position_embeddings
    )
    return gguf_path, {
        "weights_path": llama_weights(config, gguf_path),
        "num_slots": config.num_slots,
        "max_model_len": config.max_model_len,
        "n_threads": config.n_threads,
        "n_threads_batch": config.n_threads_batch,
        "threads_auto": config.n_threads is None and config.n_threads_batch is None,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "flash_attn": config.flash_attn,
    }
