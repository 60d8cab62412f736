"""Chat prompt -> token ids, reusing the exact ids a stored assistant turn was generated as.

Why: a conversation's next turn only prefills its new tokens if its prompt starts with the very
token ids whose KV the previous turn left in its slot. Re-tokenizing the previous answer's text
often gives other ids than the model generated (BPE is not unique: a model may emit "x" "1"
where the tokenizer would write "x1"), and then the prefix cache stops at the first difference,
so every turn would recompute the whole previous answer. So the template is rendered with a
sentinel in place of each stored answer; the text between answers (template text and the other
messages) is tokenized as a whole, as the plain path does, and each answer keeps its own ids.
The text before an answer is the previous turn's whole prompt (the template renders the
generation prompt as the answer's header), so turn k+1 starts with turn k's prompt + answer.

The slow twin is the plain path (render, then tokenize the whole text): the spliced ids must
decode to exactly the rendered text, or the plain path is used (a template that transforms
content, or a tokenizer that merges across the pieces, falls back safely).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ultrafast.server.prompt import client_text

_SENTINEL = "\ue000{}\ue001"  # private-use code points: never in a template's own text
_SPLIT = re.compile("\ue000([0-9]+)\ue001")


@dataclass
class ChatMessage:
    """One message of a chat prompt, the one form it travels in from a front end (or the
    session store) to the template."""

    role: str
    content: str
    # an answer this model generated: the exact ids it was generated as (reused, see above)
    token_ids: list[int] | None = None
    extra: dict = field(default_factory=dict)  # name, tool_calls, tool_call_id: template only

    def for_template(self) -> dict:
        return {"role": self.role, "content": self.content, **self.extra}


def encode_plain(
    tokenizer, messages: list[ChatMessage], template_vars: dict | None = None
) -> list[int]:
    """Render, then tokenize the whole text (client text as plain text: client_text.py)."""
    client = client_text.for_tokenizer(tokenizer)
    literals: list[str] = []
    public = client.mark(template_messages(messages), literals)
    variables = client.mark(template_vars or {}, literals)
    return client.encode(tokenizer.apply_chat_template(public, **variables), literals)


def encode_chat(
    tokenizer, messages: list[ChatMessage], template_vars: dict | None = None
) -> list[int]:
    """Token ids of the chat prompt; a message's `token_ids` are its content's ids.
    `template_vars`: extra template variables (`tools`, server/tools/render.py).
    Client text is tokenized as plain text: only the template's markup gives control ids."""
    spliced = [i for i, m in enumerate(messages) if m.token_ids]
    if not spliced:
        return encode_plain(tokenizer, messages, template_vars)
    client = client_text.for_tokenizer(tokenizer)
    literals: list[str] = []
    public = client.mark(template_messages(messages), literals)
    variables = client.mark(template_vars or {}, literals)
    marked = [
        {**m, "content": _SENTINEL.format(i)} if i in spliced else m for i, m in enumerate(public)
    ]
    pieces = _SPLIT.split(tokenizer.apply_chat_template(marked, **variables))  # text, i, ...
    if [int(i) for i in pieces[1::2]] != spliced:  # a content dropped, repeated or reordered
        return encode_plain(tokenizer, messages, template_vars)
    ids: list[int] = []
    for k, text in enumerate(pieces[0::2]):
        if text:
            ids += client.encode(text, literals)
        if k < len(spliced):
            ids += list(messages[spliced[k]].token_ids or ())
    expected = client.restore(tokenizer.apply_chat_template(public, **variables), literals)
    if tokenizer.decode(ids, skip_special_tokens=False) != expected:
        return encode_plain(tokenizer, messages, template_vars)
    return ids


def answer_token_ids(tokenizer, token_ids: list[int], text: str) -> list[int] | None:
    """The generated ids that spell `text` (trailing end-of-sequence ids dropped), or None
    when they do not (a stop string cut the text): then the text is re-tokenized next turn."""
    ids = list(token_ids)
    while ids and ids[-1] in tokenizer.eos_token_ids:
        ids.pop()
    if not ids or tokenizer.decode(ids, skip_special_tokens=False) != text:
        return None
    return ids


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    return [m.for_template() for m in messages]
