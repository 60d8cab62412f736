"""The serving benchmark's prompts: one user message per tag, grown to a token length."""

from __future__ import annotations

from pathlib import Path

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of "
    "liquor jugs near the old river bank and count every stone twice before the night "
    "falls over hills where farmers sell apples bread cheese and honey to travelers"
).split()


def make_prompts(gguf: Path, target_tokens: int, tags: list[str]) -> list[str]:
    """One user message per tag, each starting with its tag (no shared prefix beyond the chat
    template's) and grown word by word until the rendered chat prompt reaches target_tokens."""
    from ultrafast.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf)

    def length(text: str) -> int:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}])
        return len(tok.encode(rendered, add_special_tokens=False))

    prompts = []
    for tag in tags:
        text, i = f"{tag}:", 0
        while length(text) < target_tokens and i < 4 * target_tokens:
            text += " " + WORDS[i % len(WORDS)]
            i += 1
        prompts.append(text)
    return prompts
