"""`ultrafast quantize` / `eval-ppl` on the tiny model: outputs that load, and clear errors."""

from __future__ import annotations

import json

import pytest

from ultrafast.cli import main
from ultrafast.model.loader import load_model
from ultrafast.quant.linear import Int8Linear, quantized_modules

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_quantize_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--help"])
    assert exit_info.value.code == 0
    assert "--scheme" in capsys.readouterr().out


def test_missing_model_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "nope"), "--scheme", "int4"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_unknown_scheme_is_refused(tiny_llama_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", str(tiny_llama_dir), "--scheme", "int3"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_gguf_needs_blocks_of_32(tiny_llama_dir, tmp_path, capsys):
    rc = main(
        [
            "quantize",
            str(tiny_llama_dir),
            "--scheme",
            "int4",
            "--group-size",
            "64",
            "--out",
            str(tmp_path / "q"),
        ]
    )
    assert rc == 2 and "32" in capsys.readouterr().err


def test_int8_both_formats_then_eval_ppl(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "q8"
    assert main(["quantize", str(tiny_llama_dir), "--scheme", "int8", "--out", str(out)]) == 0
    config = json.loads((out / "quantization.json").read_text())
    assert config["scheme"] == "int8" and set(config["tensors"].values()) == {"int8"}
    assert set(config["gguf"]["types"].values()) == {"Q8_0"}
    model, _ = load_model(out)
    assert all(isinstance(m, Int8Linear) for m in quantized_modules(model).values())
    text = tmp_path / "heldout.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 20)
    capsys.readouterr()
    assert (
        main(
            [
                "eval-ppl",
                str(tiny_llama_dir),
                str(out),
                str(out / config["gguf"]["file"]),
                "--heldout",
                str(text),
                "--seq-len",
                "32",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert table.count("| ") >= 3 and "vs full precision" in table


def test_quantizing_a_quantized_dir_is_refused(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "q4"
    assert (
        main(
            [
                "quantize",
                str(tiny_llama_dir),
                "--scheme",
                "int4",
                "--format",
                "torch",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert main(["quantize", str(out), "--scheme", "int4"]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert main(["convert", str(out), str(tmp_path / "x.gguf")]) == 2
    assert "torch-quantized" in capsys.readouterr().err


def test_bench_markdown_compares_each_gguf_with_llama_cpp_on_the_same_file():
    from ultrafast_harness.bench.decode import markdown

    results = {
        name: {"decode_tok_s": tok_s, "ttft_ms": 1.0}
        for name, tok_s in (
            ("ultrafast-ggml[a]", 90.0),
            ("llama.cpp[a]", 100.0),
            ("ultrafast-ggml[b]", 300.0),
            ("llama.cpp[b]", 200.0),
        )
    }
    table = markdown(
        {
            "model": "m",
            "gguf": "a.gguf",
            "prompt_tokens": 4,
            "new_tokens": 8,
            "threads": 1,
            "rounds": 1,
            "results": results,
        }
    )
    assert "| ultrafast-ggml[a] | 90.0 | 1.0 | 0.90x |" in table
    assert "| ultrafast-ggml[b] | 300.0 | 1.0 | 1.50x |" in table
