"""Built-in chat templates for `--chat-template NAME`, and the flag's value resolved to a template.

A model whose files carry no chat template (a base model's GGUF, a bare HF directory) can still
be chatted with when its family's turn format is known: `--chat-template gemma` (or a Jinja file
of one's own) replaces or supplies the template. The templates are written for this project in
the common HF style (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`) and render in
the tokenizer's sandbox like a model's own. Each names the token that ends a turn in its format:
where the vocabulary has it, generation also stops there (a base model's metadata often lists
only `<eos>` as an end of generation, so without it a chat answer would run on into a new turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChatTemplate:
    text: str  # Jinja source
    end_of_turn: tuple[str, ...] = ()  # tokens that end an answer in this format
    source: str = ""  # where it came from (logs)


_CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
    " + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# Gemma has no system role: system text leads the next user turn; the assistant is `model`
_GEMMA = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}"
    "{% set ns.system = ns.system + m['content'] | trim + '\\n\\n' %}"
    "{% elif m['role'] == 'assistant' %}"
    "{{ '<start_of_turn>model\\n' + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% else %}"
    "{{ '<start_of_turn>user\\n' + ns.system + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# Mistral instruct: system text leads the next user turn; answers end with the EOS token
_MISTRAL = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}"
    "{% set ns.system = ns.system + m['content'] | trim + '\\n\\n' %}"
    "{% elif m['role'] == 'assistant' %}"
    "{{ ' ' + m['content'] | trim + eos_token }}"
    "{% else %}"
    "{{ '[INST] ' + ns.system + m['content'] | trim + ' [/INST]' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
)

_PHI = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

BUILTIN: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate(_CHATML, ("<|im_end|>",), "built-in chatml"),
    "llama3": ChatTemplate(_LLAMA3, ("<|eot_id|>",), "built-in llama3"),
    "gemma": ChatTemplate(_GEMMA, ("<end_of_turn>",), "built-in gemma"),
    "mistral": ChatTemplate(_MISTRAL, (), "built-in mistral"),
    "phi": ChatTemplate(_PHI, ("<|end|>",), "built-in phi"),
}


def builtin_names() -> str:
    return ", ".join(BUILTIN)


def resolve_chat_template(value: str) -> ChatTemplate:
    """`--chat-template`'s value: a built-in name, else a Jinja file (ValueError when it is
    neither, naming the built-ins)."""
    if value in BUILTIN:
        return BUILTIN[value]
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it: {exc}") from None
        if not text.strip():
            raise ValueError(f"--chat-template {value}: the file is empty")
        return ChatTemplate(text, (), str(path))
    raise ValueError(
        f"--chat-template {value!r} is neither a built-in template ({builtin_names()}) "
        "nor a Jinja file"
    )
