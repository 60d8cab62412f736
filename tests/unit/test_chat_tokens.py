"""Chat prompts with a stored answer's own ids (the fast path) vs render-then-tokenize (the slow
twin): same text always, same ids when the answer was tokenized canonically, and a prompt that
extends the previous turn's ids exactly (what makes the next turn a full prefix-cache hit)."""

from __future__ import annotations

import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.server.prompt.chat_tokens import ChatMessage as M
from ultrafast.server.prompt.chat_tokens import answer_token_ids, encode_chat, encode_plain
from ultrafast.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


def _non_canonical(tok, text: str) -> list[int]:
    """Ids spelling `text` one character at a time: valid, but not what encode() gives."""
    ids = []
    for ch in text:
        ids += tok.encode(ch, False)
    assert ids != tok.encode(text, False)
    return ids


def test_canonical_answer_ids_give_the_plain_prompt(tok):
    answer = "return a + b"
    messages = [
        M("user", "def add(a, b):"),
        M("assistant", answer, tok.encode(answer, False)),
        M("user", "def sub(a, b):"),
    ]
    assert encode_chat(tok, messages) == encode_plain(tok, messages)


def test_generated_ids_are_kept_and_the_next_prompt_extends_the_previous_one(tok):
    answer = "    return a - b  # x1y2"
    generated = _non_canonical(tok, answer)
    turn1 = [M("user", "def sub(a, b):")]
    prompt1 = encode_chat(tok, turn1)
    turn2 = turn1 + [M("assistant", answer, generated), M("user", "def mul(a, b):")]
    prompt2 = encode_chat(tok, turn2)
    # the slot after turn 1 holds prompt1 + generated: turn 2 starts with exactly that
    assert prompt2[: len(prompt1) + len(generated)] == prompt1 + generated
    # and it is the same text the plain path renders
    plain = encode_plain(tok, turn2)
    assert tok.decode(prompt2, skip_special_tokens=False) == tok.decode(
        plain, skip_special_tokens=False
    )
    assert prompt2 != plain


def test_a_template_that_changes_content_falls_back_to_plain(tok):
    trimmed = Tokenizer(
        tok._tok,
        {
            **tok.config,
            "chat_template": (
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
                "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
            ),
        },
    )
    answer = "  spaced answer  "
    messages = [M("user", "q"), M("assistant", answer, _non_canonical(tok, answer))]
    assert encode_chat(trimmed, messages) == encode_plain(trimmed, messages)


def test_answer_ids_drop_end_of_sequence_and_refuse_cut_text(tok):
    ids = tok.encode("return 1", False)
    eos = list(tok.eos_token_ids)
    assert answer_token_ids(tok, ids + eos, "return 1") == ids
    assert answer_token_ids(tok, ids, "return") is None  # a stop string cut the text
    assert answer_token_ids(tok, eos, "") is None
