"""A tokenizer built from a GGUF file's metadata alone, giving the token ids llama.cpp gives.

llama.cpp's byte-level BPE ("gpt2" vocab) is: split the text on special tokens, split each piece
with the regexes its `tokenizer.ggml.pre` names, map bytes to the GPT-2 byte alphabet, then merge
by rank. HF `tokenizers` does the same given the vocabulary, the merges and the same regexes as
`Split(..., "isolated")` steps, so that is what is built here. The regexes follow llama.cpp's
pre-tokenizer table (src/llama-vocab.cpp, as data in gguf_vocab_tables.py). A `pre` value outside
those families is refused rather than guessed, as is any vocabulary type other than "gpt2" and
SentencePiece "llama" (gguf_spm.py): "bert", "t5", "rwkv"... are refused, because ids that differ
from the model's training silently degrade every answer.

Token attributes follow llama.cpp too: control and unknown tokens are parsed from text and
dropped on decode unless asked for; user-defined ones are parsed and decoded verbatim; a few
control-looking texts (`<|im_end|>`, `<|eot_id|>`, ...) are control whatever their type, and they
end generation, as do the eos/eot/eom ids and the FIM pad/repo/separator tokens.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from tokenizers import Tokenizer as HFTokenizer

from ultrafast.model.config import ModelLoadError
from ultrafast.model.gguf_meta import GgufMetadata
from ultrafast.model.gguf_spm import SpmEncoder, build_spm_model, spm_piece
from ultrafast.model.gguf_vocab_tables import (
    ALWAYS_RENDERED,
    CONTROL,
    EOG_TEXTS,
    EOT_TEXTS,
    FIM_TEXTS,
    GPT2_DEFAULT_SPECIAL_ID,
    NORMAL,
    PRE_TOKENIZERS,
    SAMPLING_KEYS,
    UNKNOWN,
    USER_DEFINED,
    PreTokenizer,
)

log = logging.getLogger(__name__)


@dataclass
class GgufVocab:
    """Everything the serving tokenizer needs from the metadata."""

    hf_tokenizer: HFTokenizer
    pieces: list[bytes] = field(repr=False)  # what each id decodes to
    special: frozenset[int]  # control/unknown ids: dropped by decode(skip_special_tokens=True)
    bos_id: int | None
    eos_id: int | None
    eog_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    context_length: int | None
    sampling_defaults: dict
    pre: str
    spm: SpmEncoder | None = field(default=None, repr=False)  # for "llama" vocabularies
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _literal: HFTokenizer | None = field(default=None, repr=False)  # encode_literal's twin

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """llama.cpp's llama_tokenize(add_special=False, parse_special)."""
        if self.spm is not None:
            return self.spm.encode(text, parse_special)
        if parse_special:
            return self.hf_tokenizer.encode(text, add_special_tokens=False).ids
        return self.encode_literal(text)

    def encode_literal(self, text: str) -> list[int]:
        """llama_tokenize(parse_special=false): control tokens' text is spelled as plain text
        (user-defined tokens are still matched). A twin tokenizer does it: HF keeps the
        switch on the tokenizer object, which other threads share."""
        if self.spm is not None:
            return self.spm.encode(text, False)
        if self._literal is None:
            with self._lock:
                if self._literal is None:
                    twin = HFTokenizer.from_str(self.hf_tokenizer.to_str())
                    twin.encode_special_tokens = True
                    self._literal = twin
        return self._literal.encode(text, add_special_tokens=False).ids

    def token_text(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        return self.hf_tokenizer.id_to_token(token_id)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        n = len(self.pieces)
        out = b"".join(
            self.pieces[i]
            for i in ids
            if 0 <= i < n and not (skip_special_tokens and i in self.special)
        )
        return out.decode("utf-8", errors="replace")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte alphabet, inverted: printable bytes stand for themselves, the rest are
    shifted to U+0100 and up so every byte is a visible character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shift)] = b
            shift += 1
    return table


def _special_id(meta: GgufMetadata, key: str, n: int, default: int | None) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    if default is not None and default >= n:
        default = None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
        return value
    if value is not None:
        log.warning(
            "%s: tokenizer.ggml.%s_token_id = %r is not a token id; ignored", meta.path, key, value
        )
    return default


def _attributes(
    meta: GgufMetadata, tokens: list[str], default_bos: int | None, default_eos: int | None
) -> tuple[list[int], dict, set[int]]:
    """Effective token types after llama.cpp's text-based overrides; the special ids by role;
    the end-of-generation set."""
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * n
    if not isinstance(types, list) or len(types) < n or not all(isinstance(t, int) for t in types):
        raise ModelLoadError(f"{meta.path}: tokenizer.ggml.token_type is not one type per token")
    types = list(types[:n])
    ids = {text: i for i, text in enumerate(tokens)}
    roles = {
        "bos": _special_id(meta, "bos", n, default_bos),
        "eos": _special_id(meta, "eos", n, default_eos),
    }
    for role in ("eot", "eom", *(f"fim_{k}" for k in FIM_TEXTS)):
        roles[role] = _special_id(meta, role, n, None)
    detected = {
        "eot": EOT_TEXTS,
        "eom": ("<|eom_id|>",),
        **{f"fim_{k}": texts for k, texts in FIM_TEXTS.items()},
    }
    for role, texts in detected.items():
        if roles[role] is None:
            found = next((ids[t] for t in texts if t in ids), None)
            if found is not None:
                roles[role] = found
                types[found] = CONTROL
    eog = {i for r in ("fim_pad", "fim_rep", "fim_sep") if (i := roles[r]) is not None}
    for text in EOG_TEXTS & ids.keys():
        eog.add(ids[text])
        types[ids[text]] = CONTROL
    for text in ALWAYS_RENDERED:
        if text in ids:
            types[ids[text]] = USER_DEFINED
    eog |= {i for r in ("eos", "eot", "eom") if (i := roles[r]) is not None}
    if {"<|return|>", "<|call|>", "<|end|>"} <= ids.keys() or {
        "<|calls|>",
        "<|flush|>",
        "<|end|>",
    } <= ids.keys():
        eog.discard(ids["<|end|>"])  # harmony-style: <|end|> closes a message, not the turn
        types[ids["<|end|>"]] = USER_DEFINED
    if "<|tool_response>" in ids and "</s>" in ids:
        eog.discard(ids["</s>"])
        types[ids["</s>"]] = NORMAL
    return types, roles, eog


def _merges(meta: GgufMetadata, vocab: dict[str, int]) -> list[tuple[str, str]]:
    lines = meta.get("tokenizer.ggml.merges") or []
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise ModelLoadError(f"{meta.path}: tokenizer.ggml.merges is not a list of strings")
    merges, dropped = [], 0
    for line in lines:
        cut = line.find(" ", 1)
        left, right = (line[:cut], line[cut + 1 :]) if cut > 0 else ("", "")
        if left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
        else:
            dropped += 1  # cannot fire in llama.cpp either: its result is no token
    if dropped:
        log.info("%s: %d merges name tokens outside the vocabulary; skipped", meta.path, dropped)
    return merges


def _pieces(tokens: list[str], types: list[int]) -> list[bytes]:
    decoder = _byte_decoder()
    alphabet = frozenset(decoder)
    # each byte-level character to the byte it stands for, as a latin-1 character: one
    # translate and encode per token instead of a generator over its characters (49k
    # tokens: 0.45 s at start before)
    to_latin1 = str.maketrans({c: chr(b) for c, b in decoder.items()})
    pieces = []
    for text, kind in zip(tokens, types):
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            pieces.append(text.encode("utf-8", errors="surrogateescape"))
        elif kind == NORMAL and alphabet.issuperset(text):
            pieces.append(text.translate(to_latin1).encode("latin-1"))
        elif kind == NORMAL:  # not byte-level text: llama.cpp prints it as it is
            pieces.append(text.encode("utf-8", errors="surrogateescape"))
        else:
            pieces.append(b"")  # unused, byte and undefined tokens print nothing in llama.cpp
    return pieces


def _build_hf(tokens, types, merges, pre: PreTokenizer):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {text: i for i, text in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    hf = Tokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(types)
        if kind in (CONTROL, UNKNOWN)
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(types)
        if kind == USER_DEFINED
    ]
    hf.add_special_tokens(special)
    hf.add_tokens(user)
    return hf


def _sampling_defaults(meta: GgufMetadata) -> dict:
    out = {}
    for key, name in SAMPLING_KEYS.items():
        value = meta.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def _tokens(meta: GgufMetadata) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError(
            f"{meta.path}: tokenizer.ggml.tokens is missing or not a list of strings"
        )
    if len(set(tokens)) != len(tokens):
        raise ModelLoadError(f"{meta.path}: the vocabulary lists a token twice")
    return tokens


def _rstrip_ids(meta: GgufMetadata, tokens: list[str], types: list[int]) -> set[int]:
    """Special tokens that swallow the whitespace after them: llama.cpp sets this by model name
    for Phi-3 (every special token and </s>, but not <unk>, <s>, <|endoftext|>)."""
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    ids = {i for i, k in enumerate(types) if k in (CONTROL, UNKNOWN, USER_DEFINED)}
    ids |= {i for i, t in enumerate(tokens) if t == "</s>"}
    return ids - {i for i, t in enumerate(tokens) if t in ("<unk>", "<s>", "<|endoftext|>")}


def _spm_parts(meta: GgufMetadata, tokens: list[str], types: list[int]):
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if (
        not isinstance(scores, list)
        or len(scores) < len(tokens)
        or not all(isinstance(x, (int, float)) for x in scores)
    ):
        raise ModelLoadError(f"{meta.path}: tokenizer.ggml.scores is not one number per token")
    unk = next((tokens[i] for i, k in enumerate(types) if k == UNKNOWN), None)
    try:
        hf = build_spm_model(tokens, [float(x) for x in scores[: len(tokens)]], unk)
    except Exception as exc:  # the tokenizers library rejects a malformed vocabulary
        raise ModelLoadError(f"{meta.path}: cannot build its tokenizer: {exc}") from None
    rstrip = _rstrip_ids(meta, tokens, types)
    specials = [
        (tokens[i], i, k != USER_DEFINED, i in rstrip)
        for i, k in enumerate(types)
        if k in (CONTROL, UNKNOWN, USER_DEFINED)
    ]
    encoder = SpmEncoder(hf, specials, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    return hf, encoder, [spm_piece(t, k) for t, k in zip(tokens, types)]


def gguf_vocab(meta: GgufMetadata) -> GgufVocab:
    """Build the tokenizer; ModelLoadError when the file's tokenizer cannot be reproduced."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ModelLoadError(
            f"{meta.path} carries no tokenizer (no tokenizer.ggml.model key); "
            "put the model's tokenizer.json beside it in a directory"
        )
    if model not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{meta.path}: tokenizer type {model!r} is not supported from GGUF metadata (only "
            "byte-level BPE 'gpt2' and SentencePiece 'llama' are reproduced exactly); serve "
            "the model's Hugging Face directory with its tokenizer.json instead"
        )
    pre_name = meta.get("tokenizer.ggml.pre") or "default"
    pre = PRE_TOKENIZERS.get(pre_name) if model == "gpt2" else PreTokenizer((), add_bos=True)
    if pre is None:
        raise ModelLoadError(
            f"{meta.path}: pre-tokenizer {pre_name!r} is not supported (supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}); serve the model's Hugging Face directory "
            "with its tokenizer.json instead"
        )
    tokens = _tokens(meta)
    defaults = (GPT2_DEFAULT_SPECIAL_ID,) * 2 if model == "gpt2" else (1, 2)  # llama.cpp's
    types, roles, eog = _attributes(meta, tokens, *defaults)
    spm = None
    if model == "llama":
        hf, spm, pieces = _spm_parts(meta, tokens, types)
    else:
        vocab = {text: i for i, text in enumerate(tokens)}
        try:
            hf = _build_hf(tokens, types, _merges(meta, vocab), pre)
        except Exception as exc:  # the tokenizers library rejects a malformed vocabulary
            raise ModelLoadError(f"{meta.path}: cannot build its tokenizer: {exc}") from None
        pieces = _pieces(tokens, types)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", pre.add_bos)
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    for flag, role in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and roles[role] is None:
            raise ModelLoadError(
                f"{meta.path}: add_{role}_token is set but the file has no {role} token"
            )
    template = meta.get("tokenizer.chat_template")
    context = meta.arch_value("context_length")
    return GgufVocab(
        hf_tokenizer=hf,
        pieces=pieces,
        special=frozenset(i for i, k in enumerate(types) if k in (CONTROL, UNKNOWN)),
        bos_id=roles["bos"],
        eos_id=roles["eos"],
        eog_ids=tuple(sorted(eog)),
        add_bos=bool(add_bos),
        add_eos=bool(add_eos),
        chat_template=template if isinstance(template, str) and template.strip() else None,
        context_length=context if isinstance(context, int) and context > 0 else None,
        sampling_defaults=_sampling_defaults(meta),
        pre=pre_name if model == "gpt2" else "spm",
        spm=spm,
    )
