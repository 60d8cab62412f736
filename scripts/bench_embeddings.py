"""Embeddings per second, ultrafast's llama.cpp embedding executor beside sentence-transformers,
on the same all-MiniLM-L6-v2 weights, the same sentences and the same number of threads.

    HF_HUB_OFFLINE=1 python scripts/bench_embeddings.py --threads 2 --batches 1,32 \
        --paths ggml,torch-f32,torch-bf16,auto

Each round times every side (interleaved, so a load change hits all), `--rounds` times; the
median per batch size is printed. Every side includes tokenizing; ours runs through the
EmbeddingEngine (its queue splits a batch into passes, on its own thread), as served, once per
embedding path (executors/embed_choice.py; `auto` is the one the server measures and picks). The
model is fetched and converted by ultrafast.embed_fetch (cached); sentence-transformers comes
from the test extra.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrafast.core.embed_queue import EmbedJob  # noqa: E402
from ultrafast.embed_fetch import fetch  # noqa: E402
from ultrafast.engine.embed_engine import EmbeddingEngine  # noqa: E402
from ultrafast.executors.embed_choice import open_embedding_executor  # noqa: E402

WORDS = (
    "the a server model quickly reads writes token batch cat dog river mountain engineer "
    "report invoice coffee train moon network packet latency throughput vector search"
).split()


def sentences(n: int) -> list[str]:
    """n sentences of 8-24 words (a typical RAG chunk title or query)."""
    out = []
    for i in range(n):
        length = 8 + (i * 7) % 17
        out.append(" ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(length)) + ".")
    return out


def rate(run, texts: list[str], batch: int, min_s: float) -> tuple[float, float]:
    """(embeddings per wall second, per CPU second of this process). On a shared machine the
    second is the steadier one (with one thread; more threads add their spin-waits to it)."""
    done, started, cpu = 0, time.perf_counter(), time.process_time()
    while True:
        for i in range(0, len(texts), batch):
            run(texts[i : i + batch])
            done += len(texts[i : i + batch])
        elapsed = time.perf_counter() - started
        if elapsed >= min_s:
            return done / elapsed, done / max(time.process_time() - cpu, 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--paths", default="auto", help="ggml, torch-f32, torch-bf16, auto")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    directory, gguf = fetch()
    engines = {}
    for path in args.paths.split(","):
        executor = open_embedding_executor(str(gguf), n_threads=args.threads, path=path)
        engines[f"ultrafast {path} ({executor.path_name})"] = EmbeddingEngine(executor)
    st = SentenceTransformer(str(directory), device="cpu")
    texts = sentences(args.sentences)
    sides = {name: ours(engine) for name, engine in engines.items()}

    def run_st(chunk):
        st.encode(chunk, batch_size=len(chunk), normalize_embeddings=True)

    sides["sentence-transformers"] = run_st
    for batch in (int(b) for b in args.batches.split(",")):
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for run in sides.values():
            run(texts[:batch])  # warm-up
        for _ in range(args.rounds):
            for name, run in sides.items():
                runs[name].append(rate(run, texts, batch, args.min_seconds))
        wall = {name: round(statistics.median(w for w, _ in r), 1) for name, r in runs.items()}
        cpu = {name: round(statistics.median(c for _, c in r), 1) for name, r in runs.items()}
        peer = wall["sentence-transformers"], cpu["sentence-transformers"]
        row = {
            "batch": batch,
            "threads": args.threads,
            "embeddings_per_s": wall,
            "ratio": {name: round(w / peer[0], 2) for name, w in wall.items()},
            "embeddings_per_cpu_s": cpu,
            "cpu_ratio": {name: round(c / peer[1], 2) for name, c in cpu.items()},
        }
        print(json.dumps(row), flush=True)
    for engine in engines.values():
        engine.shutdown()
    return 0


def ours(engine: EmbeddingEngine):
    def run(chunk):
        done = threading.Event()
        ids = [engine.tokenize(t) for t in chunk]
        engine.submit(EmbedJob(ids, on_done=lambda v, e: done.set()))
        done.wait()

    return run


if __name__ == "__main__":
    sys.exit(main())
