"""The GGUF header's string arrays and the tokenizer's byte pieces, read on the start path by
faster code (model/gguf_meta.py `_Cursor.strings`, model/gguf_tokenizer.py `_pieces`): the
same values as the plain one-at-a-time definitions, truncation still caught."""

from __future__ import annotations

import struct

import pytest

from ultrafast.model import gguf_meta, gguf_tokenizer
from ultrafast.model.gguf_tokenizer import CONTROL, NORMAL, UNKNOWN, USER_DEFINED

STRINGS = ["", "hello", "Ġworld", "é", "\u2581piece", "x" * 300]
RAW = [s.encode() for s in STRINGS] + [b"\xff\xfe not utf-8"]


def _encoded(raw: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(r)) + r for r in raw)


def test_a_string_array_reads_as_one_string_at_a_time():
    buf = _encoded(RAW)
    fast = gguf_meta._Cursor(buf, len(buf)).strings(len(RAW))
    one = gguf_meta._Cursor(buf, len(buf))
    assert fast == [one.string() for _ in RAW]
    assert fast[-1].encode("utf-8", errors="surrogateescape") == RAW[-1]


@pytest.mark.parametrize("cut", [3, 8 + 2, 20])
def test_a_truncated_string_array_is_still_truncated(cut):
    buf = _encoded(RAW)[:-cut]
    with pytest.raises(gguf_meta._Truncated):
        gguf_meta._Cursor(buf, len(buf)).strings(len(RAW))


def _pieces_one_char_at_a_time(tokens, types):
    decoder = gguf_tokenizer._byte_decoder()
    out = []
    for text, kind in zip(tokens, types):
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            out.append(text.encode("utf-8", errors="surrogateescape"))
        elif kind == NORMAL and all(c in decoder for c in text):
            out.append(bytes(decoder[c] for c in text))
        elif kind == NORMAL:
            out.append(text.encode("utf-8", errors="surrogateescape"))
        else:
            out.append(b"")
    return out


def test_byte_pieces_equal_the_per_character_definition():
    alphabet = "".join(gguf_tokenizer._byte_decoder())
    tokens = [alphabet, "Ġthe", "Ċ", "<|im_end|>", "▁not-byte-level", "é", "", "a\udcff", "ab"]
    for kind in (NORMAL, CONTROL, UNKNOWN, USER_DEFINED, 6, 3):
        types = [kind] * len(tokens)
        assert gguf_tokenizer._pieces(tokens, types) == _pieces_one_char_at_a_time(tokens, types)
