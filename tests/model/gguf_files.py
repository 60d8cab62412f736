"""GGUF files for the tokenizer tests, written here with the `gguf` package: vocabulary-only files
(any pre-tokenizer, token types and special tokens we want, no tensors: llama.cpp loads them with
`vocab_only=True`), the real SmolLM2 file when the setup fetched it, and corrupted copies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ultrafast.config import DEMO_MODEL_DIR, cache_dir

SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """ULTRAFAST_SMOLLM2_GGUF, else the setup's cache (~/.cache/ultrafast/models/)."""
    env = os.environ.get("ULTRAFAST_SMOLLM2_GGUF")
    path = Path(env) if env else cache_dir() / "models" / SMOLLM2_NAME
    return path if path.is_file() else None


def require_smollm2() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip(f"{SMOLLM2_NAME} not fetched (set ULTRAFAST_SMOLLM2_GGUF or run the setup)")
    return path


def demo_vocab() -> tuple[list[str], list[int], list[str]]:
    """The demo model's tokens, GGUF token types and merges, from its tokenizer.json."""
    import gguf

    tok = json.loads((DEMO_MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(tok["model"]["vocab"])
    kinds = {}
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = (
            gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        )
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    types = [int(kinds.get(i, gguf.TokenType.NORMAL)) for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, types, merges


def spm_vocab(texts: list[str], size: int = 1500) -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece-style vocabulary (U+2581 for spaces, <0xXX> byte tokens, <unk>, <s>,
    </s>) learned from `texts`; scores fall with the id, as in Llama 2's."""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=size, special_tokens=specials, show_progress=False)
    )
    tokens = [text for text, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    types = [
        int(gguf.TokenType.UNKNOWN),
        int(gguf.TokenType.CONTROL),
        int(gguf.TokenType.CONTROL),
    ] + [int(gguf.TokenType.BYTE)] * 256
    types += [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(types))
    scores = [0.0 if kind != gguf.TokenType.NORMAL else -float(i) for i, kind in enumerate(types)]
    return tokens, types, scores


def write_vocab_gguf(
    path: Path,
    *,
    pre: str | None = "gpt-2",
    model: str = "gpt2",
    tokens=None,
    types=None,
    merges=None,
    scores=None,
    extra_tokens: dict | None = None,
    bos: int | None = 0,
    eos: int | None = 0,
    add_bos: bool | None = False,
    template: str | None = None,
    context_length: int = 2048,
    extra: dict | None = None,
    name: str = "vocab-test",
    arch: str = "llama",
) -> Path:
    """A tensor-less GGUF (architecture `arch`, llama by default) holding a byte-level BPE
    vocabulary (the demo model's unless given); `extra_tokens` appends {text: gguf token type}."""
    import gguf

    if tokens is None:
        tokens, types, merges = demo_vocab()
    tokens, types = list(tokens), list(types)
    for text, kind in (extra_tokens or {}).items():
        tokens.append(text)
        types.append(int(kind))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(1)
    writer.add_context_length(context_length)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if model == "llama":
        scores = list(scores or [0.0] * len(tokens))
        writer.add_token_scores(scores + [0.0] * (len(tokens) - len(scores)))
    if merges is not None:
        writer.add_token_merges(merges)
    if bos is not None:
        writer.add_bos_token_id(bos)
    if eos is not None:
        writer.add_eos_token_id(eos)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if template is not None:
        writer.add_chat_template(template)
    for key, value in (extra or {}).items():
        writer.add_key_value(key, value, _gguf_type(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_type(value):
    import gguf

    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.STRING


def truncated_copy(src: Path, dst: Path, keep_bytes: int) -> Path:
    dst.write_bytes(src.read_bytes()[:keep_bytes])
    return dst


def llama_cpp_requantize(src: Path, dst: Path, ftype: int = 0) -> Path:
    """llama.cpp's own rewrite of `src` as llama_ftype `ftype` (0: all F32, its dequantization;
    2: q4_0, 3: q4_1, 7: q8_0, 15: q4_K_M), quantized tensors allowed as input."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize failed ({rc}) on {src}"
    return dst
