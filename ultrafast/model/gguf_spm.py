"""llama.cpp's SentencePiece tokenizer ("llama" vocab: Llama 2, Mistral, Gemma...) from GGUF
metadata, giving llama.cpp's ids.

llama.cpp's SPM session: split the text on special tokens (each special token in order of
decreasing length splits every text fragment), put a space before a fragment that starts the
text or follows a special token (when add_space_prefix), write spaces as U+2581, then merge
adjacent pieces, always the pair whose merged piece has the highest score, and fall back to
<0xXX> byte tokens for characters outside the vocabulary. The merging is what HF `tokenizers`'
BPE does given merges ranked by the merged piece's score (how transformers converts these
vocabularies too); the splitting and the space rule are done here, because HF's Metaspace only
prefixes the first fragment.
"""

from __future__ import annotations

from ultrafast.model.gguf_vocab_tables import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED

_SPACE = "\u2581"


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a token, best merged score first."""
    ids = {text: i for i, text in enumerate(tokens)}
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
    merges = []
    for i in order:
        text = tokens[i]
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                merges.append((left, right))
    return merges


def build_spm_model(tokens: list[str], scores: list[float], unk: str | None):
    from tokenizers import Tokenizer, models

    vocab = {text: i for i, text in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores),
        byte_fallback=True,
        unk_token=unk,
        fuse_unk=False,
    )
    return Tokenizer(model)  # no normalizer, no pre-tokenizer: one fragment is one word


class SpmEncoder:
    """Text -> ids as llama.cpp's SPM session gives them."""

    def __init__(self, hf, specials: list[tuple[str, int, bool, bool]], add_space_prefix: bool):
        self._hf = hf
        # (text, id, is_control, rstrip): longest first, as llama.cpp partitions
        self._specials = sorted(specials, key=lambda s: -len(s[0].encode("utf-8")))
        self._add_space_prefix = add_space_prefix

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        fragments: list[str | int] = [text]
        for special, token_id, is_control, rstrip in self._specials:
            if is_control and not parse_special:
                continue
            out: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special not in fragment:
                    out.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(special)):
                    if k:
                        out.append(token_id)
                        if rstrip:  # the token swallows the whitespace after it (C isspace)
                            part = part.lstrip(" \t\n\v\f\r")
                    if part:
                        out.append(part)
            fragments = out
        return fragments

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        ids: list[int] = []
        previous_special = True
        for fragment in self._partition(text, parse_special) if text else []:
            if isinstance(fragment, int):
                ids.append(fragment)
                previous_special = True
                continue
            if self._add_space_prefix and previous_special:
                fragment = " " + fragment
            ids += self._hf.encode(fragment.replace(" ", _SPACE), add_special_tokens=False).ids
            previous_special = False
        return ids


def spm_piece(text: str, kind: int) -> bytes:
    """What llama.cpp prints for a token of an SPM vocabulary."""
    if kind in (CONTROL, UNKNOWN, USER_DEFINED):
        return text.encode("utf-8", errors="surrogateescape")
    if kind == NORMAL:
        return text.replace(_SPACE, " ").encode("utf-8", errors="surrogateescape")
    if kind == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    return b""
