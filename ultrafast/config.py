"""Configuration: frozen dataclasses, one per concern. The only module that reads os.environ."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL_DIR = REPO_ROOT / "models" / "demo-code"
DEMO_DRAFT_DIR = REPO_ROOT / "models" / "demo-draft"


def cache_dir() -> Path:
    """Where converted GGUF files and other derived artifacts go (ULTRAFAST_CACHE_DIR)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ultrafast"
    return Path(os.environ.get("ULTRAFAST_CACHE_DIR", default))


def default_model() -> str:
    return os.environ.get("ULTRAFAST_MODEL", str(DEMO_MODEL_DIR))


@dataclass(frozen=True)
class EngineConfig:
    model: str  # HF model directory, or a .gguf file with tokenizer.json beside it
    executor: str = "auto"  # auto (ggml on CPU, torch on CUDA), ggml, torch
    num_slots: int = 8  # KV slots: concurrent sequences plus cached prefixes
    max_model_len: int = 2048  # positions per slot (capped by the model's own limit)
    max_num_seqs: int = 8  # running at once
    max_num_batched_tokens: int = 512  # token budget per step
    max_prefill_chunk_tokens: int = 256  # chunked prefill size
    max_waiting: int = 256
    n_threads: int | None = None  # ggml threads (default: the cores we may use)
    device: str | None = None  # torch executor: cpu / cuda
    dtype: str | None = None  # torch executor: float32 / float16 / bfloat16
    gguf_type: str = "f16"  # type used when an HF directory is converted for the ggml executor

    def __post_init__(self) -> None:
        if self.executor not in ("auto", "ggml", "torch"):
            raise ValueError("executor must be auto, ggml or torch")
        if self.max_num_seqs > self.num_slots:
            raise ValueError("max_num_seqs cannot exceed num_slots")
