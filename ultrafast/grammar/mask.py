"""Packed token masks: int32 words, bit b of word w allows token 32*w + b (llguidance's
layout). Numpy only, so the engine fills them without torch; the sampler applies them."""

from __future__ import annotations

import numpy as np


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_bools(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[vocab_size]: True where the row allows the token (ids past the mask: False)."""
    bits = np.unpackbits(np.ascontiguousarray(mask_row).view(np.uint8), bitorder="little")
    out = np.zeros(vocab_size, dtype=bool)
    n = min(vocab_size, bits.size)
    out[:n] = bits[:n].astype(bool)
    return out


def allowed_ids(mask_row: np.ndarray, vocab_size: int) -> list[int]:
    return np.flatnonzero(allowed_bools(mask_row, vocab_size)).tolist()


def set_bits(mask_row: np.ndarray, token_ids) -> None:
    words = mask_row.view(np.uint32)
    for t in token_ids:
        words[t >> 5] |= np.uint32(1 << (t & 31))


def has_any(mask_row: np.ndarray, token_ids) -> bool:
    words = mask_row.view(np.uint32)
    return any(int(words[t >> 5]) >> (t & 31) & 1 for t in token_ids if t >> 5 < words.size)


def apply_mask_numpy(logits: np.ndarray, mask: np.ndarray) -> None:
    """Disallowed entries of `logits` [rows, vocab] (float32) become -inf, in place: one
    unpack for all rows (ids past the mask unpack as 0: blocked), no copy of the logits."""
    rows, vocab = logits.shape
    words = np.ascontiguousarray(mask[:rows]).view(np.uint8)
    allowed = np.unpackbits(words, axis=-1, count=vocab, bitorder="little").view(bool)
    np.putmask(logits, ~allowed, -np.inf)
