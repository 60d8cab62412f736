"""`ultrafast bench gpu` can only really run on a GPU; its measuring code runs here on a tiny
CPU model (same function, device="cpu"), and the command itself says why it cannot run."""

import json
import subprocess
import sys

import pytest

from ultrafast.model.config import ModelConfig
from ultrafast.model.loader import build_dummy_model
from ultrafast_harness.bench import gpu_check

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


TINY = {
    **gpu_check.LLAMA_1B_SHAPE,
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def test_transformers_peer_takes_our_weights():
    model = build_dummy_model(TINY, dtype="float32")
    r = gpu_check._transformers_rate(model, prompt_len=8, num_decode=6, shape=TINY, device="cpu")
    assert r["decode_tok_s"] > 0


def test_decode_rate_on_a_tiny_cpu_model():
    model = build_dummy_model(TINY, dtype="float32")
    for mode in ("off", "graphs"):
        r = gpu_check._decode_rate(
            model, mode, prompt_len=20, num_decode=12, rounds=1, device="cpu"
        )
        assert r["decode_tok_s"] > 0 and r["ttft_ms"] > 0 and r["compiled_disabled"] is None
        # graphs: every decode step after the prefill went through the static-shape path
        assert r["compiled_steps"] == (0 if mode == "off" else 2 * 12)
    report = {
        "environment": {
            "cuda": True,
            "gpu": "test",
            "gpu_memory_gib": 1,
            "torch": "x",
            "torch_cuda": "y",
        },
        "prompt_tokens": 20,
        "decode_tokens": 12,
        "roofline": {"bytes_per_token": 1e9, "bandwidth_gb_s": 100.0, "roofline_tok_s": 100.0},
        "modes": {"off": r, "inductor": {"skipped": "time budget"}},
    }
    table = gpu_check.markdown(report)
    assert "| off |" in table and "time budget" in table and "%" in table


def test_llama_1b_shape_is_1b():
    from ultrafast_harness.bench.roofline import count_weight_params

    num_params = count_weight_params(ModelConfig.from_hf(gpu_check.LLAMA_1B_SHAPE))
    assert 1.2e9 < num_params < 1.25e9  # Llama-3.2-1B: 1.24B with tied embeddings


def test_without_cuda_the_command_says_why(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "bench", "gpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "no CUDA" in done.stdout
    assert json.loads(out.read_text())["environment"]["cuda"] is False
