"""Perplexity through our engine, and its parity with llama.cpp's own on the same tokens.

Ours: every window is one request that scores its prompt (SamplingParams.prompt_logprobs, no
output token), run by the engine as the server runs it: the scheduler's chunked prefill and
batching, the ggml executor, and our log-softmax over the logits rows. llama.cpp's: the same
windows evaluated directly by llama-cpp-python with logits for every position
(quant/evaluate.py's gguf_perplexity). Same token ids, windows, context length and stride, so
the two perplexities differ only by what the engine does to the numbers.

    ultrafast eval-ppl MODEL.gguf --heldout docs/ARCHITECTURE.md --parity
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ultrafast.config import EngineConfig
from ultrafast.quant.evaluate import gguf_perplexity, windows


@dataclass(frozen=True)
class PerplexityParity:
    ours: float  # through our engine (ggml executor)
    llama_cpp: float  # llama-cpp-python directly
    num_tokens: int  # scored tokens, the same in both
    seq_len: int

    @property
    def ratio(self) -> float:
        return self.ours / self.llama_cpp


def engine_perplexity(
    gguf_path: str | Path,
    ids: list[int],
    seq_len: int = 256,
    max_tokens: int | None = None,
    n_threads: int | None = None,
    num_slots: int = 4,
) -> tuple[float, int]:
    """(perplexity, scored tokens) of `ids` in windows of seq_len + 1, through our engine."""
    from ultrafast.llm import LLM
    from ultrafast.request import Request, SamplingParams

    token_windows = windows(ids, seq_len, max_tokens)
    if not token_windows:
        raise ValueError("the held-out text has fewer than 2 tokens")
    longest = max(len(w) for w in token_windows)
    llm = LLM(
        str(gguf_path),
        executor="ggml",
        speculation="off",
        num_slots=num_slots,
        max_num_seqs=num_slots,
        max_model_len=longest + 1,  # the prompt and room for the (unused) reply
        n_threads=n_threads,
        n_threads_batch=n_threads,
    )
    scoring = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=0)
    scores: dict[str, list] = {}
    try:
        if llm.config.max_model_len <= longest:
            raise ValueError(
                f"windows of {longest} tokens exceed the model's context "
                f"({llm.config.max_model_len}): use a smaller --seq-len"
            )
        for i, window in enumerate(token_windows):
            llm.engine.add_request(Request(f"ppl-{i}", list(window), scoring))
        while llm.engine.has_work():
            for out in llm.engine.step():
                if out.error:
                    raise RuntimeError(f"scoring window {out.request_id} failed: {out.error}")
                if out.prompt_logprobs is not None:
                    scores[out.request_id] = out.prompt_logprobs
    finally:
        llm.close()
    total_nll, total = 0.0, 0
    for i, window in enumerate(token_windows):
        entries = scores[f"ppl-{i}"][1:]  # entry 0 is None: nothing precedes the first token
        if len(entries) != len(window) - 1:
            raise RuntimeError(f"window {i}: {len(entries)} scores for {len(window) - 1} tokens")
        total_nll -= sum(e.logprob for e in entries)
        total += len(entries)
    return math.exp(total_nll / total), total


def perplexity_parity(
    gguf_path: str | Path,
    ids: list[int],
    seq_len: int = 256,
    max_tokens: int | None = None,
    n_threads: int | None = None,
) -> PerplexityParity:
    ours, count = engine_perplexity(gguf_path, ids, seq_len, max_tokens, n_threads)
    # llama.cpp with the attention our engine runs (EngineConfig.flash_attn): the same
    # computation, so any gap is ours
    reference, ref_count = gguf_perplexity(
        gguf_path, ids, seq_len, max_tokens, n_threads, flash_attn=EngineConfig.flash_attn
    )
    if count != ref_count:
        raise RuntimeError(f"scored {count} tokens, llama.cpp {ref_count}")
    return PerplexityParity(ours, reference, count, seq_len)


def parity_markdown(results: dict[str, PerplexityParity]) -> str:
    lines = [
        "| model | ours (engine, ggml) | llama.cpp | ours / llama.cpp | tokens | window |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r.ours:.4f} | {r.llama_cpp:.4f} | {r.ratio:.5f} | "
            f"{r.num_tokens} | {r.seq_len} |"
        )
    return "\n".join(lines)
