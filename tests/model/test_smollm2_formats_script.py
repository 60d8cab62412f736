"""scripts/smollm2_formats.py on a tiny Q4_1 file (the real run writes SmolLM2's): every format
is written, each holds the Q4_1 values rounded only as its type must, and the HF directory
holds them exactly with a tokenizer that encodes as the GGUF's does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import pytest

from tests.model.gguf_files import llama_cpp_requantize
from ultrafast.model.gguf_meta import read_gguf_metadata

pytest.importorskip("llama_cpp")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "smollm2_formats.py"


def _script():
    spec = importlib.util.spec_from_file_location("smollm2_formats", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _types(path: Path) -> set[str]:
    meta = read_gguf_metadata(path)
    return {gguf.GGMLQuantizationType(t.ggml_type).name for t in meta.tensors if len(t.shape) > 1}


def test_every_format_from_one_q4_1_file(make_tiny_gguf, tmp_path, capsys):
    script = _script()
    q4_1 = llama_cpp_requantize(make_tiny_gguf("llama", "f32"), tmp_path / "src.gguf", 3)
    assert "Q4_1" in _types(q4_1)  # (a fallback Q8_0 embedding, as in the real file)
    out = tmp_path / "out"
    argv = ["--source", str(q4_1), "--out", str(out), "--stem", "tiny", "--threads", "1"]
    assert script.main(argv) == 0
    printed = capsys.readouterr().out
    assert "weights and tokenizer match" in printed
    paths = {name: out / f"tiny.{name}.gguf" for name in ("Q4_1", "q8_0", "f16", "bf16")}
    assert paths["Q4_1"].read_bytes() == q4_1.read_bytes()
    assert _types(paths["q8_0"]) == {"Q8_0"}
    assert _types(paths["f16"]) == {"F16"} and _types(paths["bf16"]) == {"BF16"}
    diffs = script.max_differences(q4_1, paths)
    assert diffs["Q4_1"] == 0.0
    assert 0.0 < diffs["f16"] < diffs["bf16"] < 0.05  # rounding only, finer in f16
    assert 0.0 < diffs["q8_0"] < 0.05
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (out / "hf" / name).is_file(), name
    assert script.check_hf_dir(q4_1, out / "hf") == []
