"""llama.cpp in embedding mode: token ids of several inputs -> one pooled vector per input.

One context with `embeddings = true` and the pooling the GGUF declares (`{arch}.pooling_type`:
mean, CLS or last); a model that declares none (a chat model) has no embedding mode and is
refused at load with `NoEmbeddingMode`. A pass packs several inputs as separate sequences of one
llama_batch, so one forward pass embeds a whole batch (BERT attends within each sequence:
the mask is per sequence). Encoders need the whole input in one micro-batch, so n_ubatch =
n_batch = the pass's token budget. Vectors come back L2-normalised (sentence-transformers'
Normalize module, and what OpenAI's API returns).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import llama_cpp
import numpy as np

from ultrafast.executors.ggml_open import _init_native, _meta_str
from ultrafast.executors.llama_cpp_params import NumpyBatch, model_params
from ultrafast.model.config import ModelLoadError

POOLING_NAMES = {
    llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
    llama_cpp.LLAMA_POOLING_TYPE_LAST: "last",
}


class NoEmbeddingMode(ModelLoadError):
    """The GGUF declares no pooling we serve (a chat model, or a reranker)."""


def gguf_pooling(path: str) -> str | None:
    """The pooling a GGUF declares ("mean", "cls", "last"), or None: read from the file's
    metadata alone (no weights loaded), so a server can sort its models before loading."""
    # the project's own header reader: a truncated or broken file is a ModelLoadError that
    # names it, as the loader would say, not a numpy error from mapping its tensors
    from ultrafast.model.gguf_meta import read_gguf_metadata

    pooling = read_gguf_metadata(path).arch_value("pooling_type")
    return None if pooling is None else POOLING_NAMES.get(int(pooling))


class EmbeddingExecutor:
    path_name = "ggml"  # which embedding path (executors/embed_choice.py)

    def __init__(
        self,
        gguf_path: str,
        *,
        max_batch_tokens: int = 1024,
        max_seqs: int = 64,
        pass_tokens: int = 256,
        n_threads: int | None = None,
        verbose: bool = False,
    ):
        self._log = _init_native(verbose)
        self._ctx = None
        self.gguf_path = str(gguf_path)
        self._model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), model_params())
        if not self._model:
            reason = self._log.take_errors() or "no reason given"
            raise ModelLoadError(f"llama.cpp could not load {gguf_path}: {reason}")
        self.architecture = _meta_str(self._model, "general.architecture")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_embd = llama_cpp.llama_model_n_embd(self._model)
        self.max_input_tokens = llama_cpp.llama_model_n_ctx_train(self._model)
        pooling = gguf_pooling(str(gguf_path))
        if pooling is None:
            self.close()
            raise NoEmbeddingMode(f"{gguf_path} declares no pooling: it has no embedding mode")
        self.pooling = pooling
        self.max_batch_tokens = max(max_batch_tokens, self.max_input_tokens)
        # the scheduler's pass size (core/embed_queue.py): attention spans the pass, masked per
        # input, so its cost grows with the pass squared; small passes also bound how long a
        # priority input waits. MiniLM, 1 thread, loaded machine: passes of 6, 12 and 32
        # sentences (~22 tokens each) within noise of each other per CPU-second
        self.pass_tokens = pass_tokens
        self.max_seqs = max_seqs
        self.n_threads = n_threads or max(1, len(os.sched_getaffinity(0)))
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = self.max_batch_tokens
        params.n_seq_max = max_seqs
        params.embeddings = True
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED  # the GGUF's own
        params.n_threads = params.n_threads_batch = self.n_threads
        # flash attention: without it BERT's masked attention over a 32-input pass ran 5x
        # slower per input on our CPUs (18 vs 106 embeddings per CPU-second, 1 thread)
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self._ctx:
            errors = self._log.take_errors()
            self.close()
            raise ModelLoadError(f"llama.cpp could not create an embedding context: {errors}")
        self._memory = llama_cpp.llama_get_memory(self._ctx)  # NULL for encoders (no KV)
        self._alloc_batch(self.max_batch_tokens)

    def _alloc_batch(self, capacity: int) -> None:
        b = NumpyBatch(capacity, output_flags=1)  # every position feeds the pooling
        self._numpy_batch = b
        self._tokens, self._positions, self._seq_ids = b.tokens, b.positions, b.seq_ids
        self._batch = b.batch

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """The model's own tokenizer (WordPiece for BERT): [CLS] ... [SEP] with add_special."""
        data = text.encode("utf-8", "surrogatepass")
        capacity = len(data) + 8
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(
            self._vocab, data, len(data), buf, capacity, add_special, False
        )
        if n < 0:  # too small (cannot happen: a token covers at least one byte, plus specials)
            buf = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, -n, add_special, False)
        return list(buf[:n])

    def sep_token(self) -> int:
        """The token that ends an input ([SEP] for BERT), kept by truncation; -1: none."""
        return int(llama_cpp.llama_vocab_sep(self._vocab))

    def check_pass(self, inputs: Sequence[Sequence[int]]) -> int:
        """The pass's token count, or a ValueError saying why it cannot run (both paths)."""
        total = sum(len(ids) for ids in inputs)
        if not inputs or len(inputs) > self.max_seqs or total > self.max_batch_tokens:
            raise ValueError(
                f"a pass takes 1-{self.max_seqs} inputs and at most {self.max_batch_tokens} "
                f"tokens; got {len(inputs)} inputs, {total} tokens"
            )
        for ids in inputs:
            if not ids:
                raise ValueError("an empty input has no embedding")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"a token id is out of range [0, {self.vocab_size})")
        return total

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One forward pass: (len(inputs), n_embd) float32, each row L2-normalised."""
        total = self.check_pass(inputs)
        start = 0
        for seq, ids in enumerate(inputs):
            n = len(ids)
            self._tokens[start : start + n] = ids
            self._positions[start : start + n] = np.arange(n, dtype=np.int32)
            self._seq_ids[start : start + n] = seq
            start += n
        self._batch.n_tokens = total
        if self._memory:
            llama_cpp.llama_memory_clear(self._memory, True)
        status = llama_cpp.llama_decode(self._ctx, self._batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} on {total} tokens")
        out = np.empty((len(inputs), self.n_embd), dtype=np.float32)
        for seq in range(len(inputs)):
            ptr = llama_cpp.llama_get_embeddings_seq(self._ctx, seq)
            if not ptr:
                raise RuntimeError(f"llama.cpp returned no pooled embedding for sequence {seq}")
            row = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))
            out[seq] = np.ctypeslib.as_array(row, (self.n_embd,))
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)

    def close(self) -> None:
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None
