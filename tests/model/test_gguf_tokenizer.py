"""A tokenizer from GGUF metadata alone gives llama.cpp's own ids, text and special tokens.

The reference is llama.cpp itself (llama-cpp-python, `vocab_only=True`): ids for every .py/.md
file of the repo plus Unicode, emoji, CJK, whitespace runs, digit runs and special-token text,
with special tokens parsed and not; decoded text with special tokens kept and dropped; the
end-of-generation set, BOS and the add-BOS flag. Run on vocabulary-only GGUFs for each supported
pre-tokenizer family, on a SentencePiece ("llama") vocabulary, and on the real SmolLM2 file when
the setup fetched it.
"""

from __future__ import annotations

import ctypes

import gguf
import pytest

from tests.model.gguf_files import require_smollm2, spm_vocab, write_vocab_gguf
from ultrafast.config import REPO_ROOT
from ultrafast.model.config import ModelLoadError
from ultrafast.model.gguf_meta import read_gguf_metadata
from ultrafast.model.gguf_tokenizer import gguf_vocab
from ultrafast.tokenizer import Tokenizer

llama_cpp = pytest.importorskip("llama_cpp")

HAND_TEXTS = [
    "héllo wörld ✓ 日本語 🙂 中文字符 한국어 😀👍🏽 👨‍👩‍👧 Ünïcödé ÆØÅ ñ ß ﬁ",
    "   \t\t  \n\n\n  \r\n x  \u00a0 \u3000 y\u2028z \u200b",
    " leading",
    "trailing  ",
    "\n",
    "1234567890 3.14159 1e10 ٣٤٥ ⅷ 0x1F 12,345,678 ２０２６",
    "don't I'll we've THEY'RE it's 'quoted'",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_start|>x<|endoftext|>y<|im_end",
    "a<tool>b <tool> c<|eot_id|>",
    "def f(x):\n\treturn {'a': [1, 2]}  # ok\n",
    "",
]


def _outside_the_project(parts: tuple[str, ...]) -> bool:
    """Hidden folders (.git, .venv, .venv-vllm with all of torch and vLLM, .tools) and the
    benchmarks' scratch (runs/) are not the project's own text."""
    return any(part.startswith(".") for part in parts[:-1]) or parts[0] == "runs"


def repo_texts(limit: int | None = None) -> list[str]:
    files = sorted(
        p
        for pattern in ("*.py", "*.md")
        for p in REPO_ROOT.rglob(pattern)
        if not _outside_the_project(p.relative_to(REPO_ROOT).parts)
    )
    return [p.read_text(encoding="utf-8", errors="replace") for p in files[:limit]]


class LlamaCppVocab:
    def __init__(self, path):
        self.llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab

    def encode(self, text: str, special: bool) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)

    def decode(self, ids: list[int], special: bool) -> str:
        """What llama.cpp prints token by token (llama_token_to_piece, no clean-up)."""
        buf, out = ctypes.create_string_buffer(512), b""
        for i in ids:
            n = llama_cpp.llama_token_to_piece(self.vocab, i, buf, 512, 0, special)
            out += buf.raw[:n]
        return out.decode("utf-8", errors="replace")

    def eog_ids(self) -> tuple[int, ...]:
        return tuple(
            i for i in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(self.vocab, i)
        )


def assert_parity(path, texts: list[str]) -> None:
    tok, ref = Tokenizer.from_gguf(path), LlamaCppVocab(path)
    vocab = gguf_vocab(read_gguf_metadata(path))  # for special-token text as plain text
    for text in texts:
        ids = ref.encode(text, special=True)
        assert tok.encode(text, add_special_tokens=False) == ids, text[:200]
        assert vocab.encode(text, parse_special=False) == ref.encode(text, special=False), text[
            :200
        ]
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, special=True)
        assert tok.decode(ids) == ref.decode(ids, special=False)
    assert tok.eos_token_ids == ref.eog_ids()
    assert tok.bos_token_id == llama_cpp.llama_vocab_bos(ref.vocab)
    assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(ref.vocab)


EXTRA = {"<tool>": gguf.TokenType.USER_DEFINED, "<|eot_id|>": gguf.TokenType.NORMAL}


@pytest.mark.parametrize(
    "pre", ["gpt-2", "smollm", "llama-bpe", "qwen2", "default", "falcon", None]
)
def test_each_pre_tokenizer_family_matches_llama_cpp(tmp_path, pre):
    path = write_vocab_gguf(tmp_path / "v.gguf", pre=pre, extra_tokens=EXTRA)
    assert_parity(path, HAND_TEXTS + repo_texts(limit=12))


def test_whole_repo_on_the_demo_vocabulary(tmp_path):
    path = write_vocab_gguf(tmp_path / "v.gguf", pre="gpt-2", extra_tokens=EXTRA)
    assert_parity(path, HAND_TEXTS + repo_texts())


@pytest.mark.real_model
def test_smollm2_matches_llama_cpp_on_the_whole_repo():
    path = require_smollm2()
    assert_parity(path, HAND_TEXTS + repo_texts())
    tok = Tokenizer.from_gguf(path)
    assert tok.eos_token_ids == (0, 2, 4)  # <|endoftext|>, <|im_end|>, <reponame> (FIM repo)
    assert tok.eos_token == "<|im_end|>" and tok.context_length == 8192
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    assert tok.encode(chat, add_special_tokens=False)[0] == 1  # <|im_start|> parsed as special


def test_metadata_gives_template_context_specials_and_flags(tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    path = write_vocab_gguf(
        tmp_path / "v.gguf",
        bos=1,
        eos=2,
        add_bos=True,
        template=template,
        context_length=123456,
        extra_tokens=EXTRA,
        extra={"tokenizer.ggml.eot_token_id": 4097, "general.sampling.top_k": 7},
    )
    tok = Tokenizer.from_gguf(path)
    assert tok.context_length == 123456 and tok.generation_defaults == {"top_k": 7}
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1
    assert 2 in tok.eos_token_ids and 4097 in tok.eos_token_ids
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x"
    assert "GGUF" in tok.source


def test_incremental_detokenizer_on_a_gguf_vocabulary(tmp_path):
    tok = Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "v.gguf", extra_tokens=EXTRA))
    text = "héllo 日本語 🙂 <tool> x  y\n"
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer()
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize(
    "add_space_prefix,name", [(None, "spm"), (False, "spm"), (None, "Phi-3 mini")]
)
def test_sentencepiece_vocabulary_matches_llama_cpp(tmp_path, add_space_prefix, name):
    """A Llama-2-style vocabulary: U+2581 spaces, scores, <0xXX> byte fallback, <s>/</s>;
    named Phi-3, its special tokens swallow the whitespace after them, as in llama.cpp."""
    tokens, types, scores = spm_vocab(repo_texts(limit=40))
    extra = {} if add_space_prefix is None else {"tokenizer.ggml.add_space_prefix": False}
    path = write_vocab_gguf(
        tmp_path / "spm.gguf",
        model="llama",
        pre=None,
        tokens=tokens,
        types=types,
        scores=scores,
        bos=1,
        eos=2,
        add_bos=None,
        extra=extra,
        extra_tokens={
            **EXTRA,
            "<|im_start|>": gguf.TokenType.CONTROL,
            "<|endoftext|>": gguf.TokenType.CONTROL,
        },
        name=name,
    )
    assert_parity(path, HAND_TEXTS + repo_texts())
    tok = Tokenizer.from_gguf(path)
    assert tok.add_bos and tok.encode("x")[0] == 1 and 2 in tok.eos_token_ids
    assert (
        tok.decode(tok.encode("héllo 日本語 🙂", add_special_tokens=False)).strip()
        == "héllo 日本語 🙂"
    )


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv"])
def test_a_vocabulary_type_we_cannot_reproduce_is_refused_by_name(tmp_path, model):
    path = write_vocab_gguf(tmp_path / "v.gguf", model=model, pre=None, merges=None)
    with pytest.raises(ModelLoadError, match=f"tokenizer type '{model}'"):
        Tokenizer.from_gguf(path)


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path):
    path = write_vocab_gguf(tmp_path / "v.gguf", pre="tekken")
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'tekken'"):
        Tokenizer.from_gguf(path)


def test_a_gguf_without_a_vocabulary_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.add_context_length(64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        Tokenizer.from_gguf(tmp_path / "bare.gguf")
