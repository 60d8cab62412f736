"""Text <-> token ids: HF `tokenizers`, the model's chat template, incremental detokenizing, stops.

Only the HTTP layer and the offline API use this; the engine sees token ids. Chat templates come
from the model's tokenizer_config.json and render in jinja2's immutable sandbox (clients can
never send a template).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

_REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|endoftext|>", ...} in newer configs
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict, generation_eos: list[int] | None = None):
        self._tok = tokenizer
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = [self._tok.token_to_id(self.eos_token)] if self.eos_token else []
        self.eos_token_ids = tuple(sorted({i for i in eos + (generation_eos or []) if i is not None}))
        self.add_bos = bool(config.get("add_bos_token", False))
        self.chat_template = config.get("chat_template")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           undefined=jinja2.StrictUndefined)
        env.globals["raise_exception"] = _raise_template_error
        self._template = env.from_string(self.chat_template) if self.chat_template else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        generation_eos: list[int] = []
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            generation_eos = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return cls(HFTokenizer.from_file(str(path)), config, generation_eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use the completions API")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def detokenizer(self, prompt_token_ids: list[int] | None = None) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_token_ids or [])


def _raise_template_error(message: str):
    raise ValueError(f"chat template error: {message}")


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without re-decoding everything each step.

    Byte-level BPE can split one character over several tokens; text is only emitted once it
    no longer ends in a partial character, and a few tokens of left context keep the merge
    behaviour (leading spaces) right.
    """

    _CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-self._CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # ids before this are already emitted
        self.text = ""

    def push(self, token_ids: list[int]) -> str:
        """Add new ids; return the newly stable text (may be empty)."""
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset])
        full = decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or an unfinished multi-byte character
        delta = full[len(prefix):]
        self._prefix_offset = max(self._read_offset, len(self._ids) - self._CONTEXT_TOKENS)
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is left, even a broken character."""
        full = self._tokenizer.decode(self._ids[self._prefix_offset:])
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self._read_offset = len(self._ids)
        self._prefix_offset = self._read_offset
        self.text += delta
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back any tail that could start one."""

    def __init__(self, stops: list[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = list(stops)
        self._held = ""
        self._hold = max((len(s) for s in stops), default=1) - 1

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped). Text after a stop string is dropped."""
        text = self._held + delta
        if not self.stops:
            return text, False
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        keep = self._longest_partial_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, text: str) -> int:
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
