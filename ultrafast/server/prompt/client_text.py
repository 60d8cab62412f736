"""Client text never becomes control tokens: special-token text in a message is plain text.

A chat prompt is the template's markup around the client's strings. Tokenizing the rendered
text as a whole parses every `<|im_start|>`, `<|im_end|>`, `<s>` ... as its control token, also
inside a message's content, so a user could close their own turn and forge a `system` or
`assistant` turn. Here every client string (content, names, tool calls' arguments, tool
definitions: anything handed to the template) has each special token's text replaced by a
mark `\\ue002<i>\\ue003` before the template renders. After rendering, every special-token text
left is the template's own: the text is split at those (each becomes its control id) and in
the pieces between them the marks are put back and tokenized as plain text (llama.cpp's
`parse_special=false`: control tokens are spelled out, user-defined tokens stay).

Strings without special text are untouched and the prompt is tokenized exactly as before (the
common case costs one regex scan per string). The private-use characters of the marks (and of
chat_tokens.py's answer sentinels) are themselves marked when a client sends them, so no
client string can fake a mark. `/v1/completions` takes a raw prompt and does not come here: it
keeps parsing special-token text, as llama.cpp and vLLM do.
"""

from __future__ import annotations

import re
import threading
from typing import Any

_PRIVATE = ("\ue000", "\ue001", "\ue002", "\ue003")  # sentinels (chat_tokens.py) and marks
_MARK = "\ue002{}\ue003"
_MARKED = re.compile("\ue002([0-9]+)\ue003")


class ClientText:
    """The special tokens of one tokenizer, and the marking and tokenizing that keep client
    text plain. Built once per tokenizer (`for_tokenizer`)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.specials: dict[str, int] = {t: i for t, i in tokenizer.special_tokens.items() if t}
        self._find = re.compile(_longest_match([*self.specials, *_PRIVATE]))
        self._split = (
            re.compile("(" + _longest_match(list(self.specials)) + ")") if self.specials else None
        )

    def mark(self, value: Any, literals: list[str]) -> Any:
        """`value` (str, dict, list, tuple, nested) with special text in its strings replaced
        by marks; the replaced texts are appended to `literals` (a mark's index)."""
        if isinstance(value, str):
            if not self._find.search(value):
                return value
            return self._find.sub(lambda m: self._mark_one(m.group(0), literals), value)
        if isinstance(value, dict):
            return {k: self.mark(v, literals) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.mark(v, literals) for v in value)
        return value

    @staticmethod
    def _mark_one(text: str, literals: list[str]) -> str:
        literals.append(text)
        return _MARK.format(len(literals) - 1)

    @staticmethod
    def restore(text: str, literals: list[str]) -> str:
        """The rendered text as the model reads it: each mark back to the client's text."""
        if not literals:
            return text
        return _MARKED.sub(lambda m: _literal(literals, m.group(1)), text)

    def encode(self, text: str, literals: list[str]) -> list[int]:
        """Ids of rendered text: the template's special-token text as control ids, marked
        client text as plain text. Without marks: the tokenizer's own encode, unchanged."""
        if not literals:
            return self.tokenizer.encode(text, False)
        pieces = self._split.split(text) if self._split is not None else [text]
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:  # a separator the split kept: the template's own special token
                ids.append(self.specials[piece])
            elif piece:
                ids += self.tokenizer.encode_literal(self.restore(piece, literals))
        return ids


def _longest_match(texts: list[str]) -> str:
    """A regex matching any of `texts`, the longest where several start at one place, as a
    prefix tree: a vocabulary has up to thousands of special tokens (Gemma's `<unused..>`),
    and a flat alternation would try each of them at every `<` of a message."""
    trie: dict = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}  # a text ends here
    return _pattern(trie)


def _pattern(node: dict) -> str:
    branches = [re.escape(ch) + _pattern(child) for ch, child in sorted(node.items()) if ch]
    if not branches:
        return ""
    if "" in node:  # a shorter text ends here: the longer branches are tried first
        return "(?:" + "|".join(branches) + ")?"
    return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"


def _literal(literals: list[str], index: str) -> str:
    i = int(index)
    return literals[i] if i < len(literals) else ""


_CACHE: dict[int, ClientText] = {}
_CACHE_LOCK = threading.Lock()


def for_tokenizer(tokenizer: Any) -> ClientText:
    """The ClientText of `tokenizer` (cached by identity; a tokenizer lives as long as its
    model, and a server holds a handful)."""
    key = id(tokenizer)
    with _CACHE_LOCK:
        found = _CACHE.get(key)
        if found is None or found.tokenizer is not tokenizer:
            if len(_CACHE) > 64:
                _CACHE.clear()
            found = _CACHE[key] = ClientText(tokenizer)
        return found
