"""Which path runs an embedding model's passes: llama.cpp, or PyTorch in f32 or bf16, chosen by
timing each on this machine at start, never by the CPU's name.

Why measure: which is faster depends on the CPU's GEMM units and the libraries' kernels for
them (on an AMX Xeon torch's bf16 GEMMs through oneDNN are several times llama.cpp's f32 ones;
elsewhere llama.cpp may win), on the thread count and on the model's shape. So each candidate
embeds the same 32 typical inputs, split into passes as the scheduler would split them for it,
a few times interleaved; the cheapest wins, and PyTorch only when it beats llama.cpp by
`MARGIN` (ggml stays on a tie). Cheapest in this process's CPU time, best of the rounds: both
paths keep their n_threads busy for the whole pass, so on an idle machine CPU time is threads
x wall time for either, and on a shared one (ours: 2 cores, load 20) it leaves out the time
other processes took, which made wall-clock choices flip from run to run; the log line gives
both. bf16 is a candidate only when its vectors keep a cosine of at
least `BF16_MIN_COSINE` with llama.cpp's f32 ones on those inputs. One log line says the choice
and the times. ULTRAFAST_EMBED_PATH=ggml|torch-f32|torch-bf16 forces a path (tests, operators).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from ultrafast.executors.ggml_embed import EmbeddingExecutor

log = logging.getLogger(__name__)

PATHS = ("ggml", "torch-f32", "torch-bf16")
MARGIN = 0.9  # PyTorch must take at most this share of llama.cpp's time
BF16_MIN_COSINE = 0.9995
_WORDS = (
    "the a server model quickly reads writes token batch cat dog river mountain engineer "
    "report invoice coffee train moon network packet latency throughput vector search"
).split()


def calibration_texts(n: int = 32) -> list[str]:
    """n sentences of 8-24 words (a typical RAG chunk title or query)."""
    return [
        " ".join(_WORDS[(i * 5 + j * 3) % len(_WORDS)] for j in range(8 + (i * 7) % 17)) + "."
        for i in range(n)
    ]


def open_embedding_executor(
    gguf_path: str, n_threads: int | None = None, path: str | None = None
) -> Any:
    """The model's embedding executor on the measured (or forced) path."""
    ggml = EmbeddingExecutor(gguf_path, n_threads=n_threads)
    forced = path or os.environ.get("ULTRAFAST_EMBED_PATH") or "auto"
    if forced not in (*PATHS, "auto"):
        ggml.close()
        raise ValueError(f"ULTRAFAST_EMBED_PATH={forced!r}: expected auto or one of {PATHS}")
    if forced == "ggml":
        return ggml
    try:
        candidates = _torch_candidates(ggml, [forced] if forced != "auto" else PATHS[1:])
    except (ValueError, KeyError) as exc:  # an architecture or file the torch pass lacks
        if forced != "auto":
            ggml.close()
            raise ValueError(f"{gguf_path}: no {forced} embedding pass: {exc}") from exc
        log.info("embedding passes: ggml (no PyTorch pass for this model: %s)", exc)
        return ggml
    if forced != "auto":
        return candidates[forced]
    return choose(ggml, candidates)


def _torch_candidates(ggml: EmbeddingExecutor, names) -> dict[str, Any]:
    import torch

    from ultrafast.executors.torch_embed import TorchEmbeddingExecutor

    dtypes = {"torch-f32": torch.float32, "torch-bf16": torch.bfloat16}
    torch.set_num_threads(ggml.n_threads)  # the same threads as llama.cpp's pass
    return {name: TorchEmbeddingExecutor(ggml, dtypes[name]) for name in names}


def choose(ggml: EmbeddingExecutor, candidates: dict[str, Any], rounds: int = 3) -> Any:
    """The fastest of llama.cpp and `candidates` on a calibration batch (see the module doc)."""
    inputs = [ggml.tokenize(text) for text in calibration_texts()]
    every = {"ggml": ggml, **candidates}
    # a first, untimed pass on every path (oneDNN builds its kernels for each new shape on
    # first use), whose vectors also gate bf16 against llama.cpp's f32 ones
    vectors = {name: _embed_all(executor, inputs) for name, executor in every.items()}
    notes = []
    if "torch-bf16" in every:
        cosine = float((vectors["torch-bf16"] * vectors["ggml"]).sum(1).min())
        if cosine < BF16_MIN_COSINE:
            del every["torch-bf16"]
            notes.append(f"bf16 left out: cosine {cosine:.5f} < {BF16_MIN_COSINE}")
    best = {name: (float("inf"), float("inf")) for name in every}  # (CPU s, wall s)
    for _ in range(rounds):  # interleaved, so a load change hits every path
        for name, executor in every.items():
            best[name] = min(best[name], _time_batch(executor, inputs))
    chosen = min(best, key=lambda name: best[name])
    if chosen != "ggml" and best[chosen][0] > MARGIN * best["ggml"][0]:
        chosen = "ggml"
    times = ", ".join(
        f"{name} {cpu * 1000:.0f} ms CPU / {wall * 1000:.0f} ms"
        for name, (cpu, wall) in best.items()
    )
    log.info(
        "embedding passes: %s (%d inputs on %d threads: %s%s)",
        chosen,
        len(inputs),
        ggml.n_threads,
        times,
        "; " + "; ".join(notes) if notes else "",
    )
    return every[chosen]


def _embed_all(executor: Any, inputs: list[list[int]]) -> np.ndarray:
    chunks = passes(inputs, executor.pass_tokens, executor.max_seqs)
    return np.concatenate([executor.embed(chunk) for chunk in chunks])


def _time_batch(executor: Any, inputs: list[list[int]]) -> tuple[float, float]:
    """(CPU, wall) seconds to embed `inputs` in the passes the scheduler makes for it."""
    cpu, started = time.process_time(), time.perf_counter()
    for chunk in passes(inputs, executor.pass_tokens, executor.max_seqs):
        executor.embed(chunk)
    return time.process_time() - cpu, time.perf_counter() - started


def passes(inputs: list[list[int]], pass_tokens: int, max_seqs: int) -> list[list[list[int]]]:
    """`inputs` split as core/embed_queue.py splits a waiting batch (a pass takes inputs until
    the next would pass `pass_tokens` or `max_seqs`; it always takes one)."""
    out: list[list[list[int]]] = []
    tokens = 0
    for ids in inputs:
        if out and len(out[-1]) < max_seqs and tokens + len(ids) <= pass_tokens:
            out[-1].append(ids)
            tokens += len(ids)
        else:
            out.append([ids])
            tokens = len(ids)
    return out
