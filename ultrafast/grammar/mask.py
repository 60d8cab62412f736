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


class AllowedIdsCache:
    """The allowed ids of recently seen mask rows that allow few tokens. A grammar's rows
    repeat (its states recur: after a digit, inside a string), and an argmax over a handful
    of ids costs a fraction of unpacking and blocking the whole vocabulary. Bounded: at
    `max_entries` rows it starts over; a row allowing more than `max_ids` is remembered as
    None (the caller blocks the row instead)."""

    def __init__(self, max_entries: int = 256, max_ids: int = 1024):
        self.max_entries, self.max_ids = max_entries, max_ids
        self._ids: dict[bytes, np.ndarray | None] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, mask_row: np.ndarray) -> np.ndarray | None:
        """int64 ids the row allows, ascending (ids past the vocabulary included), or None
        when it allows more than max_ids."""
        key = mask_row.tobytes()
        if key in self._ids:
            return self._ids[key]
        bits = np.unpackbits(np.frombuffer(key, dtype=np.uint8), bitorder="little")
        ids: np.ndarray | None = np.flatnonzero(bits)
        if ids is not None and ids.size > self.max_ids:
            ids = None
        if len(self._ids) >= self.max_entries:
            self._ids.clear()
        self._ids[key] = ids
        return ids


def set_bits(mask_row: np.ndarray, token_ids) -> None:
    words = mask_row.view(np.uint32)
    for t in token_ids:
        words[t >> 5] |= np.uint32(1 << (t & 31))


def apply_mask_numpy(logits: np.ndarray, mask: np.ndarray) -> None:
    """Disallowed entries of `logits` [rows, vocab] (float32) become -inf, in place: one
    unpack for all rows (ids past the mask unpack as 0: blocked), no copy of the logits."""
    rows, vocab = logits.shape
    words = np.ascontiguousarray(mask[:rows]).view(np.uint8)
    allowed = np.unpackbits(words, axis=-1, count=vocab, bitorder="little").view(bool)
    np.putmask(logits, ~allowed, -np.inf)
