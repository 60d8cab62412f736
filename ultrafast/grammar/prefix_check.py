"""Was a constrained answer complete where a client's stop string cut it?

The engine's grammar step keeps every answer inside its grammar, and turns an unfinished one
that ends on EOS into `length` (engine/grammar_steps.py). A client's `stop` string is matched
later, on the text (server/generate.py), and may cut the answer anywhere: inside a JSON
string, between a key and its value, inside a tool call. Such a cut answer must not finish
`stop` (issue 29 item 2), so at the match the server asks a fresh matcher of the same grammar
whether the text before the stop string is a complete answer.

The matcher follows the choice's own token ids while their bytes are the text's; the rest of
the text (the token the stop string began inside, or text the detokenizer spelled otherwise)
is tokenized anew. llguidance matches bytes, so any tokenization of the same text leads to
the same state; a special token the output text does not show (the detokenizer skips them) is
passed over.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ultrafast.grammar.spec import GrammarSpec


def accepts_text(
    runtime: Any,
    spec: GrammarSpec,
    token_ids: Sequence[int],
    text: str,
    keep_ids: Collection[int] = (),
) -> bool:
    """True when `text` (the start of the output that `token_ids` generated) is a complete
    answer of `spec`. `runtime`: the model's grammar.matcher.GrammarRuntime; `keep_ids`: the
    special tokens whose text the output shows. False when the grammar cannot be had."""
    try:
        matcher = runtime.cache.new_matcher(spec)
    except ValueError:  # it does not compile (the request would have been refused)
        return False
    lltok = runtime.lltokenizer
    data, pos, ids = text.encode("utf-8", "surrogatepass"), 0, []
    for token in token_ids:
        if lltok.is_special_token(token) and token not in keep_ids:
            continue  # not in the text: EOS, a template token the output skips
        piece = lltok.decode_bytes([token])
        if not piece or not data.startswith(piece, pos):
            break  # the stop string began inside this token, or the text reads otherwise
        ids.append(token)
        pos += len(piece)
    if pos < len(data):
        ids += lltok.tokenize_bytes(data[pos:])
    if ids and not matcher.consume_tokens(ids):
        return False
    return matcher.is_accepting() and not matcher.is_error()
