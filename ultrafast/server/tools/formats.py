"""Tool-call formats: how one model family spells a call in its output.

A format is the literal text around each call's JSON object and the key that holds the
arguments. The grammar (grammar.py) forces exactly this spelling; the parser (parse.py) reads
it back. `generic` is ours: the server describes the tools in a system block (render.py) and
the grammar keeps the model inside the format, so any instruct model can call tools.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str  # the text that opens a call (or a block of calls)
    begin: str  # text after the trigger, before the first call's `{`
    end: str  # text after the call (or the block), closing it
    separator: str  # between two calls
    args_key: str = "arguments"
    native: bool = False  # the model's chat template renders `tools` itself
    trigger_in_call: bool = False  # the trigger is the start of the call's own JSON
    array: bool = False  # one block holds all calls as a JSON array (begin/end: brackets)

    def open_text(self) -> str:
        return self.trigger + self.begin

    def special_tokens(self, vocabulary: Mapping[str, int]) -> dict[str, int]:
        """The special tokens (text -> id, from the model's `vocabulary` of them) that this
        format's texts contain: Mistral's `[TOOL_CALLS]` is one control token in Mistral
        tokenizers, so the grammar must name that token and the output must keep its text."""
        texts = (self.trigger, self.begin, self.end, self.separator)
        return {t: i for t, i in vocabulary.items() if t and any(t in s for s in texts)}


HERMES = ToolFormat("hermes", "<tool_call>", "\n", "\n</tool_call>", "\n", native=True)
LLAMA3_JSON = ToolFormat(
    "llama3_json", '{"name":', "", "", "; ", "parameters", native=True, trigger_in_call=True
)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "[", "]", ",", native=True, array=True)
GENERIC = ToolFormat("generic", "<tool_call>", "", "</tool_call>", "")

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, GENERIC)}


def detect_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template's own tool support uses, or `generic` when it has none.

    A template supports tools when it reads the `tools` variable; the call syntax it teaches
    the model tells the family apart."""
    src = chat_template or ""
    if "tools" not in src:
        return GENERIC
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "<tool_call>" in src:
        return HERMES
    if "<|python_tag|>" in src or "<|eom_id|>" in src or '"parameters"' in src:
        return LLAMA3_JSON
    return GENERIC
