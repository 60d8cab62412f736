"""Text <-> token ids: HF `tokenizers`, the model's chat template, incremental detokenizing, stops.

Only the HTTP layer and the offline API use this; the engine sees token ids. A tokenizer comes
from an HF directory (tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json) or from a GGUF file's metadata alone (`from_gguf`, same ids as
llama.cpp). Chat templates render in jinja2's immutable sandbox (clients can never send a
template); a template that fails on a request is a ChatTemplateError, which the server answers
with a 400.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from ultrafast.chat_templates import builtin_names
from ultrafast.model.config import ModelLoadError

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to
# generation_config.json keys the server may use as default sampling values
_SAMPLING_DEFAULT_KEYS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
}


class ChatTemplateError(ValueError):
    """A chat request this model's template cannot render: a client error (HTTP 400)."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template at all; completions still work."""


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|endoftext|>", ...} in newer configs
        return value.get("content")
    return value


def _template_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """What HF chat templates expect (transformers' own environment): trimmed blocks,
    loop controls, `raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
        extensions=[jinja2.ext.loopcontrols],
    )
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(str(fmt))
    env.filters["tojson"] = _tojson
    return env


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _json_object(path: Path) -> dict:
    """A JSON object file, {} when absent; a broken one is a ModelLoadError naming it."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _eos_ids(value) -> list[int]:
    ids = value if isinstance(value, list) else ([value] if value is not None else [])
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def _generation_config(model_dir: Path) -> tuple[list[int], dict]:
    """EOS ids (an int or a list) and default sampling values from generation_config.json."""
    path = model_dir / "generation_config.json"
    gen = _json_object(path)
    eos = gen.get("eos_token_id")
    eos_ids = _eos_ids(eos)
    if eos is not None and len(eos_ids) != (len(eos) if isinstance(eos, list) else 1):
        raise ModelLoadError(f"{path}: eos_token_id must be a token id or a list of them")
    defaults = {}
    for key, kind in _SAMPLING_DEFAULT_KEYS.items():
        value = gen.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[key] = kind(value)
        elif value is not None:
            log.warning("%s: %s = %r is not a number; ignored", path, key, value)
    return eos_ids, defaults


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        config: dict,
        generation_eos: list[int] | None = None,
        *,
        encode_fn: Callable[[str], list[int]] | None = None,
        encode_literal_fn: Callable[[str], list[int]] | None = None,
        decode_fn: Callable[[list[int], bool], str] | None = None,
        add_eos: bool = False,
        context_length: int | None = None,
        generation_defaults: dict | None = None,
        source: str = "tokenizer.json",
        special_ids: frozenset[int] | None = None,
    ):
        """`special_ids`: the ids `decode_fn` drops with skip_special_tokens (default: the
        added tokens marked special, the ones HF `tokenizers` drops)."""
        self._tok = tokenizer
        self._encode_fn = encode_fn  # GGUF vocabularies: llama.cpp's own ids and text
        self._encode_literal_fn = encode_literal_fn  # the same, special text spelled out
        self._literal_tok: HFTokenizer | None = None  # built on first use (encode_literal)
        self._literal_lock = threading.Lock()
        self._decode_fn = decode_fn
        if special_ids is None:
            added = tokenizer.get_added_tokens_decoder()
            special_ids = frozenset(i for i, t in added.items() if t.special)
        self.special_ids = special_ids
        self._special_tokens: dict[str, int] | None = None
        self.config = config
        self.source = source  # where the vocabulary came from (logs, tests)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        eos = [self.eos_token_id]
        self.eos_token_ids = tuple(
            sorted({i for i in eos + (generation_eos or []) if i is not None})
        )
        self.add_bos = bool(config.get("add_bos_token", False))
        self.add_eos = add_eos
        self.context_length = context_length  # the model's declared context, if known
        # default sampling values the model ships (temperature, top_p, top_k, ...): a request
        # that does not set one may use these
        self.generation_defaults = dict(generation_defaults or {})
        self.chat_template: str | None = None
        self._template: jinja2.Template | None = None
        self._template_problem: str | None = None
        self._set_template(config.get("chat_template"))

    def _set_template(self, text: str | None) -> None:
        self.chat_template = text
        self._template = None
        self._template_problem = None
        if text:
            try:
                self._template = _template_env().from_string(text)
            except jinja2.TemplateError as exc:  # chat fails per request; completions still work
                self._template_problem = f"the chat template does not compile: {exc}"
                log.warning("%s; chat requests will be refused", self._template_problem)

    def use_chat_template(self, text: str, end_of_turn: tuple[str, ...] = ()) -> None:
        """Replace (or supply) the chat template (`--chat-template`); the tokens in
        `end_of_turn` that this vocabulary has also end a generation."""
        self._set_template(text)
        extra = [self._tok.token_to_id(t) for t in end_of_turn]
        ids = {i for i in extra if i is not None} | set(self.eos_token_ids)
        self.eos_token_ids = tuple(sorted(ids))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        config = _json_object(model_dir / "tokenizer_config.json")
        # recent transformers write the template to chat_template.jinja (and, as transformers
        # does on load, that file wins over a template left in tokenizer_config.json)
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.is_file():
            config = {**config, "chat_template": jinja_path.read_text(encoding="utf-8")}
        elif isinstance(config.get("chat_template"), list):  # [{"name": ..., "template": ...}]
            named = {
                t.get("name"): t.get("template")
                for t in config["chat_template"]
                if isinstance(t, dict)
            }
            config = {**config, "chat_template": named.get("default")}
        special_map = _json_object(model_dir / "special_tokens_map.json")  # older layouts
        for key in ("bos_token", "eos_token"):
            if config.get(key) is None and special_map.get(key) is not None:
                config = {**config, key: special_map[key]}
        generation_eos, defaults = _generation_config(model_dir)
        if not generation_eos:  # no generation_config.json: the model config's EOS ids
            generation_eos = _eos_ids(_json_object(model_dir / "config.json").get("eos_token_id"))
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library's own parse error
            raise ModelLoadError(f"{path} cannot be loaded: {exc}") from None
        return cls(hf, config, generation_eos, generation_defaults=defaults, source=str(path))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer, special tokens, end-of-generation ids, chat template and context
        length from a GGUF file's metadata (ModelLoadError if it cannot be reproduced)."""
        from ultrafast.model.gguf_meta import read_gguf_metadata
        from ultrafast.model.gguf_tokenizer import gguf_vocab

        vocab = gguf_vocab(read_gguf_metadata(path))
        config = {
            "bos_token": vocab.token_text(vocab.bos_id),
            "eos_token": vocab.token_text(vocab.eos_id),
            "add_bos_token": vocab.add_bos,
            "chat_template": vocab.chat_template,
        }
        return cls(
            vocab.hf_tokenizer,
            config,
            list(vocab.eog_ids),
            encode_fn=vocab.encode,
            encode_literal_fn=vocab.encode_literal,
            decode_fn=vocab.decode,
            add_eos=vocab.add_eos,
            context_length=vocab.context_length,
            generation_defaults=vocab.sampling_defaults,
            source=f"GGUF metadata of {Path(path).name}",
            special_ids=vocab.special,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The HF `tokenizers` definition as JSON (what llguidance builds its vocabulary from)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._encode_fn is not None:
            ids = self._encode_fn(text)
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if add_special_tokens and self.add_eos and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def warm_up(self) -> None:
        """Build what the first chat request would otherwise build: `encode_literal`'s twin
        tokenizer (a JSON round trip of the vocabulary: 0.16 s for 49k tokens)."""
        self.encode_literal("")

    def encode_literal(self, text: str) -> list[int]:
        """Ids of `text` with special-token text spelled out as plain text (llama.cpp's
        parse_special=false; user-defined added tokens are still matched): how a chat message's
        client text is tokenized (server/prompt/client_text.py)."""
        if self._encode_literal_fn is not None:
            return self._encode_literal_fn(text)
        if self._literal_tok is None:
            with self._literal_lock:
                if self._literal_tok is None:  # a twin: the switch is per tokenizer object
                    twin = HFTokenizer.from_str(self._tok.to_str())
                    twin.encode_special_tokens = True
                    self._literal_tok = twin
        return self._literal_tok.encode(text, add_special_tokens=False).ids

    @property
    def special_tokens(self) -> dict[str, int]:
        """Text -> id of each special token (one that decode skips; llguidance keeps it out of
        free text, a grammar names it as `<[id]>`)."""
        if self._special_tokens is None:
            texts = ((self._tok.id_to_token(i), i) for i in sorted(self.special_ids))
            self._special_tokens = {t: i for t, i in texts if t}
        return self._special_tokens

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        keep_ids: frozenset[int] = frozenset(),
    ) -> str:
        """`keep_ids`: special tokens whose text stays although the others are skipped (a tool
        call's trigger token, which the tool parser must see)."""
        if skip_special_tokens and keep_ids and not keep_ids.isdisjoint(token_ids):
            dropped = self.special_ids - keep_ids
            token_ids = [t for t in token_ids if t not in dropped]
            skip_special_tokens = False
        if self._decode_fn is not None:
            return self._decode_fn(token_ids, skip_special_tokens)
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_vars
    ) -> str:
        """Render the chat prompt; ChatTemplateError (a 400) when the template cannot."""
        if self._template_problem:
            raise ChatTemplateError(self._template_problem)
        if self._template is None:
            raise NoChatTemplateError(
                "this model has no chat template: start it with --chat-template NAME "
                f"(built-in: {builtin_names()}) or --chat-template FILE.jinja, "
                "or send raw text to /v1/completions"
            )
        # as transformers renders: `tools` and `documents` are always defined (None when the
        # request has none), so templates may test them with a bare `{% if tools %}`
        template_vars = {"tools": None, "documents": None, **template_vars}
        try:
            return self._template.render(
                **template_vars,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"the chat template tried an unsafe operation: {exc}") from None
        except Exception as exc:  # whatever the template raises is about these messages
            raise ChatTemplateError(
                f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None

    def detokenizer(
        self, prompt_token_ids: list[int] | None = None, keep_ids: frozenset[int] = frozenset()
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids or [], keep_ids)


def _raise_template_error(message: str):
    raise ChatTemplateError(f"chat template error: {message}")


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without re-decoding everything each step.

    Byte-level BPE can split one character over several tokens; text is only emitted once it
    no longer ends in a partial character, and a few tokens of left context keep the merge
    behaviour (leading spaces) right.
    """

    _CONTEXT_TOKENS = 4

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        keep_ids: frozenset[int] = frozenset(),
    ):
        self._tokenizer = tokenizer
        self._keep_ids = keep_ids  # special tokens whose text the output keeps
        self._ids = list(prompt_token_ids[-self._CONTEXT_TOKENS :])
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # ids before this are already emitted
        self.text = ""

    def push(self, token_ids: list[int]) -> str:
        """Add new ids; return the newly stable text (may be empty)."""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or an unfinished multi-byte character
        delta = full[len(prefix) :]
        self._prefix_offset = max(self._read_offset, len(self._ids) - self._CONTEXT_TOKENS)
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, keep_ids=self._keep_ids)

    def flush(self) -> str:
        """At the end of generation: whatever is left, even a broken character."""
        full = self._decode(self._ids[self._prefix_offset :])
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
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
        self.matched: str | None = None  # the stop string that ended the text, once one did
        self._held = ""
        self._hold = max((len(s) for s in stops), default=1) - 1

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped). Text after a stop string is dropped."""
        text = self._held + delta
        if not self.stops:
            return text, False
        found = [(i, k) for k, i in enumerate(text.find(s) for s in self.stops) if i >= 0]
        if found:
            cut, k = min(found)
            self.matched, self._held = self.stops[k], ""
            return text[:cut], True
        keep = self._longest_partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, text: str) -> int:
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
