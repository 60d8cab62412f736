"""A stand-in for executors/ggml_embed.EmbeddingExecutor: a word tokenizer and a vector that
depends on every id of its input, so a mixed-up batch row or a dropped input shows."""

from __future__ import annotations

import threading

import numpy as np

CLS, SEP = 1, 2


class FakeEmbedExecutor:
    pooling = "mean"
    architecture = "fake-bert"

    def __init__(self, n_embd=8, vocab_size=100, max_input_tokens=16, max_seqs=8, gate=None):
        self.n_embd = n_embd
        self.vocab_size = vocab_size
        self.max_input_tokens = max_input_tokens
        self.max_batch_tokens = 64
        self.max_seqs = max_seqs
        self.passes: list[list[list[int]]] = []  # the inputs of each pass, in order
        self.gate = gate  # a threading.Event the first pass waits for (None: no wait)
        self.entered = threading.Event()
        self.closed = False

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        words = [3 + sum(map(ord, w)) % (self.vocab_size - 3) for w in text.split()]
        return [CLS, *words, SEP] if add_special else words

    def sep_token(self) -> int:
        return SEP

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        self.entered.set()
        if self.gate is not None and not self.passes:
            self.gate.wait(10)
        self.passes.append([list(x) for x in inputs])
        return np.stack([vector(x, self.n_embd) for x in inputs])

    def close(self) -> None:
        self.closed = True


def vector(ids: list[int], n_embd: int = 8) -> np.ndarray:
    out = np.zeros(n_embd, dtype=np.float32)
    for pos, token in enumerate(ids):
        out[(token + pos) % n_embd] += 1.0 + token / 100
    return out / np.linalg.norm(out)
