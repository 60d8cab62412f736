"""The llguidance view of a model's vocabulary, built once per model.

From the serving tokenizer's HF `tokenizers` object (a model directory's tokenizer.json, or
the one `Tokenizer.from_gguf` rebuilds from a GGUF's metadata with llama.cpp's ids), so both
kinds of model get the same token bytes the engine decodes with.
"""

from __future__ import annotations

import llguidance

from ultrafast.tokenizer import Tokenizer


class GrammarUnavailable(RuntimeError):
    """This model's vocabulary cannot drive llguidance (constrained decoding is refused)."""


def build_lltokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """`vocab_size`: the width of the executor's logits (may exceed the tokenizer's: padding
    rows; the mask never allows them). EOS: every end-of-generation id the engine stops on."""
    if not tokenizer.eos_token_ids:
        raise GrammarUnavailable("the tokenizer names no end-of-sequence token")
    try:
        return llguidance.LLTokenizer(
            tokenizer.backend_json(),
            n_vocab=vocab_size,
            eos_token=list(tokenizer.eos_token_ids),
        )
    except Exception as exc:  # llguidance's own message: an unsupported tokenizer kind
        raise GrammarUnavailable(f"llguidance cannot use this tokenizer: {exc}") from None
