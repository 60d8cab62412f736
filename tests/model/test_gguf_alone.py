"""A .gguf file with nothing beside it is a whole model: `ultrafast generate --model x.gguf`
works from its metadata alone, the same as the HF directory it was converted from; broken files
are clear errors with a non-zero exit, never a traceback.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys

import gguf
import pytest

from tests.model.gguf_files import require_smollm2, truncated_copy, write_vocab_gguf
from ultrafast.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from ultrafast.model.config import ModelLoadError
from ultrafast.model.gguf_meta import read_gguf_metadata
from ultrafast.model_files import gguf_for, load_tokenizer, resolve_model, tokenizer_fingerprint

PROMPT = "def fibonacci(n):"


def ultrafast(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def lone_gguf(tmp_path_factory):
    """The demo model converted by `ultrafast convert`, then copied alone into an empty dir."""
    work = tmp_path_factory.mktemp("convert")
    done = ultrafast("convert", str(DEMO_MODEL_DIR), str(work / "demo.gguf"))
    assert done.returncode == 0, done.stderr
    alone = tmp_path_factory.mktemp("alone") / "demo-code.gguf"
    shutil.copy(work / "demo.gguf", alone)
    assert [p.name for p in alone.parent.iterdir()] == ["demo-code.gguf"]
    return alone


def test_convert_writes_what_a_lone_gguf_needs(lone_gguf):
    meta = read_gguf_metadata(lone_gguf)
    assert meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.merges")
    assert "<|im_start|>" in meta.get("tokenizer.chat_template")
    files = resolve_model(lone_gguf)
    assert files.tokenizer_gguf == lone_gguf and files.hf_dir is None
    assert files.max_position_embeddings == meta.get("llama.context_length")
    from_gguf, from_dir = load_tokenizer(files), load_tokenizer(resolve_model(DEMO_MODEL_DIR))
    assert from_gguf.eos_token_ids == from_dir.eos_token_ids
    assert from_gguf.chat_template == from_dir.chat_template
    text = "def f(x):\n    return x  # héllo 🙂\n<|im_start|>user"
    assert from_gguf.encode(text) == from_dir.encode(text)


def test_generate_from_the_lone_gguf_equals_the_hf_directory(lone_gguf):
    args = [PROMPT, "--max-tokens", "24", "--threads", "1", "--spec", "off"]
    alone = ultrafast("generate", "--model", str(lone_gguf), *args)
    assert alone.returncode == 0, alone.stderr
    directory = ultrafast("generate", "--model", str(DEMO_MODEL_DIR), *args)
    assert directory.returncode == 0, directory.stderr
    assert alone.stdout.startswith(PROMPT) and len(alone.stdout) > len(PROMPT) + 10
    assert alone.stdout == directory.stdout


def test_the_draft_check_compares_vocabularies_not_files(lone_gguf, tmp_path):
    assert tokenizer_fingerprint(resolve_model(lone_gguf)) == tokenizer_fingerprint(
        resolve_model(DEMO_DRAFT_DIR)
    )
    other = write_vocab_gguf(
        tmp_path / "other.gguf", extra_tokens={"<extra>": gguf.TokenType.USER_DEFINED}
    )
    assert tokenizer_fingerprint(resolve_model(other)) != tokenizer_fingerprint(
        resolve_model(DEMO_DRAFT_DIR)
    )


def test_the_gguf_tokenizer_wins_over_a_tokenizer_json_beside_it(lone_gguf, tmp_path, caplog):
    shutil.copy(lone_gguf, tmp_path / "model.gguf")
    shutil.copy(DEMO_MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    caplog.set_level("INFO", logger="ultrafast.model_files")
    tok = load_tokenizer(resolve_model(tmp_path / "model.gguf"))
    assert "GGUF" in tok.source and "is ignored" in caplog.text
    # a directory holding the GGUF and a tokenizer.json is an HF layout: tokenizer.json
    assert load_tokenizer(resolve_model(tmp_path)).source.endswith("tokenizer.json")
    (tmp_path / "tokenizer.json").unlink()
    assert "GGUF" in load_tokenizer(resolve_model(tmp_path)).source


def test_an_unreproducible_gguf_tokenizer_falls_back_to_tokenizer_json_beside_it(tmp_path):
    write_vocab_gguf(tmp_path / "model.gguf", model="bert")
    with pytest.raises(ModelLoadError, match="tokenizer type 'bert'"):
        load_tokenizer(resolve_model(tmp_path / "model.gguf"))
    shutil.copy(DEMO_MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    assert load_tokenizer(resolve_model(tmp_path / "model.gguf")).source.endswith("tokenizer.json")


def _patch_context_length(path, value: int) -> None:
    data = bytearray(path.read_bytes())
    key = b"llama.context_length"
    at = data.index(key) + len(key)
    (vtype,) = struct.unpack_from("<I", data, at)
    assert vtype == gguf.GGUFValueType.UINT32
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(bytes(data))


def test_a_declared_context_beyond_memory_is_capped_at_max_model_len(lone_gguf, tmp_path):
    """Declared 2**31 - 1 positions; the KV cache holds --max-model-len (default 2048) per
    slot, so nothing near the declared size is ever allocated."""
    huge = tmp_path / "huge.gguf"
    shutil.copy(lone_gguf, huge)
    _patch_context_length(huge, 2**31 - 1)
    assert resolve_model(huge).max_position_embeddings == 2**31 - 1
    done = ultrafast(
        "generate",
        "--model",
        str(huge),
        PROMPT,
        "--max-tokens",
        "4",
        "--threads",
        "1",
        "--spec",
        "off",
    )
    assert done.returncode == 0, done.stderr


def test_a_kv_cache_beyond_memory_is_refused_before_llama_cpp(lone_gguf, tmp_path):
    """Raising --max-model-len towards a huge declared context: a clear error, exit 2."""
    huge = tmp_path / "huge.gguf"
    shutil.copy(lone_gguf, huge)
    _patch_context_length(huge, 2**31 - 1)
    done = ultrafast(
        "generate",
        "--model",
        str(huge),
        PROMPT,
        "--max-tokens",
        "4",
        "--max-model-len",
        str(2**31 - 1),
        "--spec",
        "off",
        timeout=120,
    )
    assert done.returncode == 2 and "KV cache" in done.stderr, done.stderr
    assert "--max-model-len" in done.stderr and "Traceback" not in done.stderr


def test_kv_budget_arithmetic(lone_gguf):
    from ultrafast.model.kv_budget import check_kv_fits, kv_bytes_per_position

    per_position = kv_bytes_per_position(lone_gguf, None)
    assert per_position == kv_bytes_per_position(None, DEMO_MODEL_DIR) > 0
    check_kv_fits(lone_gguf, None, 4, 1000, 2048, available=per_position * 4000)
    with pytest.raises(ModelLoadError, match="about 1,000 fits") as info:
        check_kv_fits(lone_gguf, None, 4, 1001, 2048, available=per_position * 4000)
    assert "declares 2,048" in str(info.value)


@pytest.mark.parametrize("keep", [0, 3, 40, 5000, -1000])
def test_a_truncated_gguf_is_a_clear_error_and_exit_2(lone_gguf, tmp_path, keep):
    size = lone_gguf.stat().st_size
    bad = truncated_copy(lone_gguf, tmp_path / "bad.gguf", keep if keep >= 0 else size + keep)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        resolve_model(bad)
    if keep in (40, -1000):  # the CLI path, once per kind (each run starts a Python)
        done = ultrafast("generate", "x", "--model", str(bad), timeout=120)
        assert done.returncode == 2 and "bad.gguf" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_a_corrupt_gguf_is_a_clear_error(lone_gguf, tmp_path):
    data = bytearray(lone_gguf.read_bytes())
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(data[4:]))
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        resolve_model(not_gguf)
    huge_count = tmp_path / "count.gguf"
    struct.pack_into("<Q", data, 16, 2**62)  # the key/value count
    huge_count.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="count.gguf"):
        resolve_model(huge_count)


def test_a_directory_gguf_is_checked_before_llama_cpp_sees_it(lone_gguf, tmp_path):
    shutil.copytree(DEMO_MODEL_DIR, tmp_path / "m")
    truncated_copy(lone_gguf, tmp_path / "m" / "demo-code-f16.gguf", 100_000)
    with pytest.raises(ModelLoadError, match="truncated"):
        gguf_for(resolve_model(tmp_path / "m"))


def test_an_unsupported_tokenizer_stops_the_cli_with_its_name(tmp_path):
    path = write_vocab_gguf(tmp_path / "wpm.gguf", model="bert")
    done = ultrafast("generate", "x", "--model", str(path), timeout=120)
    assert done.returncode == 2 and "tokenizer type 'bert'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.real_model
def test_smollm2_answers_from_its_gguf_alone(tmp_path):
    from ultrafast.llm import LLM
    from ultrafast.request import SamplingParams

    alone = tmp_path / "smollm2.gguf"
    alone.symlink_to(require_smollm2())
    llm = LLM(str(alone), speculation="off", n_threads=2, num_slots=2, max_num_seqs=2)
    try:
        prompt = llm.tokenizer.apply_chat_template(
            [
                {"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"},
            ]
        )
        out = llm.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0))[0]
    finally:
        llm.close()
    assert "Paris" in out.text and out.finish_reason == "stop", out
    assert out.token_ids[-1] in (0, 2, 4) and len(out.token_ids) < 48


@pytest.mark.real_model
def test_smollm2_hf_directory_as_transformers_writes_it(tmp_path):
    """The issue's layout: tokenizer.json + chat_template.jinja saved by transformers. Its chat
    template is read; a .gguf path beside it still uses the GGUF's own vocabulary."""
    transformers = pytest.importorskip("transformers")
    from ultrafast.tokenizer import Tokenizer

    src = require_smollm2()
    hf = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    hf.save_pretrained(str(tmp_path))
    assert (tmp_path / "chat_template.jinja").is_file()
    messages = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    from_dir, from_gguf = Tokenizer.from_dir(tmp_path), Tokenizer.from_gguf(src)
    assert from_dir.apply_chat_template(messages) == from_gguf.apply_chat_template(messages)
    assert 2 in from_dir.eos_token_ids
    (tmp_path / "smollm2.gguf").symlink_to(src)
    assert "GGUF" in load_tokenizer(resolve_model(tmp_path / "smollm2.gguf")).source


def test_random_corruption_is_always_a_model_load_error_or_a_tokenizer(tmp_path):
    """Bytes flipped anywhere (mostly in the header): never another exception, never a hang."""
    import random

    from ultrafast.tokenizer import Tokenizer

    data = write_vocab_gguf(tmp_path / "v.gguf", template="{{ messages }}").read_bytes()
    rng, outcomes = random.Random(0), {"ok": 0, "refused": 0}
    for _ in range(150):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            span = len(buf) if rng.random() < 0.5 else 400
            buf[rng.randrange(span)] = rng.randrange(256)
        (tmp_path / "x.gguf").write_bytes(bytes(buf))
        try:
            Tokenizer.from_gguf(tmp_path / "x.gguf")
            outcomes["ok"] += 1
        except ModelLoadError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0 and outcomes["ok"] > 0


def test_convert_names_a_digit_splitting_pre_tokenizer(tmp_path):
    """A SmolLM/StarCoder-style tokenizer.json (digits split apart, then GPT-2's regex) is
    written as pre "smollm", so the lone GGUF tokenizes numbers as the model was trained."""
    import json

    from ultrafast.convert import convert_hf_to_gguf
    from ultrafast.tokenizer import Tokenizer

    src = tmp_path / "digits"
    shutil.copytree(DEMO_MODEL_DIR, src, ignore=shutil.ignore_patterns("*.gguf"))
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    tok["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, tok["pre_tokenizer"]],
    }
    (src / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    out = convert_hf_to_gguf(src, tmp_path / "digits.gguf")
    assert read_gguf_metadata(out).get("tokenizer.ggml.pre") == "smollm"
    text = "x = 12345 + 3.14159\n\n2026 items, 10 000 000 ok"
    ids = Tokenizer.from_dir(src).encode(text, add_special_tokens=False)
    assert Tokenizer.from_gguf(out).encode(text, add_special_tokens=False) == ids
    assert len(ids) > len(Tokenizer.from_dir(DEMO_MODEL_DIR).encode(text, False))
