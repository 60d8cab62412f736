"""The hybrid scheme on the bundled demo model (11M parameters, trained): held-out perplexity
within 5% of full precision on both paths, and the GGUF export predicting the same next tokens
as the torch-quantized model.

Cheap settings (512 calibration tokens, 2,048 held-out tokens) keep this under a minute on two
cores; the figures for the full held-out set come from `ultrafast quantize --eval`
(BENCHMARKS.md). Argmax agreement is teacher-forced (every position predicted from the true
prefix), so one early flip cannot cascade: llama.cpp rounds activations to 8 bits for q4_0
dot products, which may flip near-ties, so at least 90% of the positions must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ultrafast.cli import main
from ultrafast.model.attention import SeqSpan, SlotKVCache
from ultrafast.model.loader import load_model
from ultrafast.quant.evaluate import heldout_ids

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-code"
pytestmark = [
    pytest.mark.usefixtures("one_cpu_thread"),
    pytest.mark.skipif(not (DEMO / "model.safetensors").is_file(), reason="demo model not present"),
]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo_hybrid") / "demo-code-hybrid"
    rc = main(
        [
            "quantize",
            str(DEMO),
            "--scheme",
            "hybrid",
            "--out",
            str(out),
            "--calibration-tokens",
            "512",
            "--eval",
            "--eval-tokens",
            "2048",
        ]
    )
    assert rc == 0
    return out


def test_hybrid_perplexity_within_5_percent_of_full_precision(hybrid_dir):
    config = json.loads((hybrid_dir / "quantization.json").read_text())
    ppl = {label: r["perplexity"] for label, r in config["perplexity"].items()}
    assert ppl["hybrid (torch)"] / ppl["fp (torch)"] < 1.05
    assert ppl["hybrid (gguf)"] / ppl["f16 (gguf)"] < 1.05
    # the plan is recorded, mostly int4, and the kept tensors are the measured-most-sensitive
    plan, report = config["tensors"], config["hybrid"]
    kept = [n for n, t in plan.items() if t == "f16"]
    assert sum(t == "int4" for t in plan.values()) > 0.8 * len(plan)
    ranked = sorted(report["sensitivity"], key=report["sensitivity"].get, reverse=True)
    assert kept == [] or kept[0] in ranked[:3]


def test_gguf_and_torch_hybrid_predict_the_same_tokens(hybrid_dir):
    from ultrafast.executors.llama_cpp_params import open_llama

    config = json.loads((hybrid_dir / "quantization.json").read_text())
    window = heldout_ids(DEMO)[1000:1129]
    model, _ = load_model(hybrid_dir)
    cfg = model.config
    kv = SlotKVCache(
        cfg.num_hidden_layers, 1, 256, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu"
    )
    with torch.inference_mode():
        ids = torch.tensor(window[:-1])
        attn = kv.begin_step([SeqSpan(0, 0, ids.numel())])
        hidden = model(ids, torch.arange(ids.numel()), attn)
        torch_argmax = model.compute_logits(hidden).argmax(-1).numpy()
    llm = open_llama(
        str(hybrid_dir / config["gguf"]["file"]), n_ctx=256, logits_all=True, verbose=False
    )
    llm.eval(window[:-1])
    ggml_argmax = np.asarray(llm.scores[: len(window) - 1]).argmax(-1)
    llm.close()
    assert (torch_argmax == ggml_argmax).mean() >= 0.9
