"""Perplexity through our engine (ggml executor, prompt logprobs) equals llama.cpp's own on
the same token ids and windows: on the demo model's GGUF (always) and on SmolLM2 (real_model,
within the 0.5% issue 17 asks for). `ultrafast eval-ppl --parity` prints both."""

from __future__ import annotations

import json

import pytest

from ultrafast.cli import main
from ultrafast.config import DEMO_MODEL_DIR, REPO_ROOT

HELDOUT = REPO_ROOT / "docs" / "ARCHITECTURE.md"  # written for this repo: no model trained on it


def parity_via_cli(gguf, capsys, *extra: str) -> dict:
    args = ["eval-ppl", str(gguf), "--heldout", str(HELDOUT), "--parity", "--threads", "2"]
    capsys.readouterr()
    assert main([*args, *extra]) == 0
    out = capsys.readouterr().out
    assert "| ours (engine, ggml) | llama.cpp |" in out
    (result,) = json.loads(out[out.index("{") :]).values()
    return result


def test_demo_gguf_engine_perplexity_equals_llama_cpp(capsys):
    r = parity_via_cli(
        DEMO_MODEL_DIR / "demo-code-f16.gguf", capsys, "--seq-len", "48", "--eval-tokens", "144"
    )
    assert r["num_tokens"] == 144 and r["ours"] > 1.0
    assert abs(r["ratio"] - 1) <= 0.005, r


@pytest.mark.real_model
def test_smollm2_engine_perplexity_equals_llama_cpp(capsys):
    from tests.model.gguf_files import require_smollm2

    r = parity_via_cli(require_smollm2(), capsys, "--seq-len", "64", "--eval-tokens", "192")
    assert r["num_tokens"] == 192 and r["ours"] > 1.0
    assert abs(r["ours"] / r["llama_cpp"] - 1) <= 0.005, r


def test_parity_needs_a_gguf(capsys):
    assert main(["eval-ppl", str(DEMO_MODEL_DIR), "--parity"]) == 2
    assert "--parity compares .gguf files" in capsys.readouterr().err
