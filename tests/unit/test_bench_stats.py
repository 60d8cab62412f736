"""The harness's arithmetic: percentiles, prompts, summaries, ratios, and the roofline's byte
count (checked against a real model's parameters)."""

import pytest

from ultrafast_harness.bench.harness import make_prompts, percentiles_ms, ratios, summarize
from ultrafast_harness.bench.peers import Batch, Stream
from ultrafast_harness.bench.roofline import count_weight_params, kv_bytes_per_position, roofline


def test_percentiles_nearest_rank():
    p = percentiles_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert p["p50"] == pytest.approx(51) and p["p90"] == pytest.approx(90)
    assert p["p99"] == pytest.approx(99) and percentiles_ms([]) is None


def test_prompts_differ_per_stream_and_round_but_share_a_length():
    base = list(range(100, 120))
    seen = set()
    for round_idx in range(3):
        prompts = make_prompts(base, 4096, 16, round_idx)
        assert {len(p) for p in prompts} == {22}
        seen.update(tuple(p[:2]) for p in prompts)
        assert all(0 <= t < 4096 for p in prompts for t in p)
    assert len(seen) == 48  # no prefix is shared: no prefix-cache hit for anyone


def test_summary_and_ratios():
    fast = Batch([Stream([0.01, 0.02, 0.03], 3), Stream([0.02, 0.03, 0.04], 3)], 0.04)
    slow = Batch([Stream([0.10, 0.30, 0.50], 3)], 0.5)
    s = summarize([fast])
    assert s["num_streams"] == 2 and s["num_tokens"] == 6
    assert s["tok_s"] == pytest.approx(150) and s["decode_tok_s_per_stream"] == pytest.approx(100)
    assert s["itl_ms"]["p50"] == pytest.approx(10) and len(s["samples"]["itl_ms"]) == 4
    r = ratios({"ours-engine": s, "llama.cpp": summarize([slow])})
    pair = r["ours-engine / llama.cpp"]
    assert pair["tok_s"] == pytest.approx(150 / 6) and pair["itl_p50"] == pytest.approx(0.05)
    assert list(r) == ["ours-engine / llama.cpp"]
    # a runner without per-token stamps (vllm offline) still has tokens/s, and no TTFT
    blind = summarize([Batch([Stream([], 8)], 0.5)])
    assert blind["ttft_ms"] is None and blind["itl_ms"] is None and blind["tok_s"] == 16


@pytest.mark.parametrize("tied", [True, False])
def test_weight_count_matches_the_model(tied):
    from ultrafast.model.config import ModelConfig
    from ultrafast.model.loader import build_dummy_model

    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 80,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": tied,
    }
    model = build_dummy_model(hf)
    unique = {id(p): p.numel() for p in model.parameters()}
    config = ModelConfig.from_hf(hf)
    assert count_weight_params(config) == sum(unique.values())
    assert kv_bytes_per_position(config, 2.0) == 2 * 3 * 2 * 8 * 2
    line = roofline(1000, 10, 50.0, bandwidth_gb_s=1.5)
    assert line.bytes_per_token == 1500 and line.roofline_tok_s == pytest.approx(1e6)
    assert line.fraction(5e5) == pytest.approx(0.5)
