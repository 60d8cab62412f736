"""The HF <-> GGUF name tables and the q/k RoPE row order are written once; the reader's
direction is their inverse."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ultrafast import convert
from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.model import gguf_names
from ultrafast.model.gguf_meta import read_gguf_metadata
from ultrafast.model.gguf_names import (
    GGUF_ARCHITECTURES,
    from_interleaved_rope,
    gguf_tensor_name,
    hf_tensor_name,
    interleaved_rope_rows,
    rope_heads,
    to_interleaved_rope,
)
from ultrafast.model.gguf_weights import gguf_model_config, gguf_tensors

HF_TENSORS = [
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    *(f"model.layers.7.{stem}.weight" for stem in gguf_names._PER_LAYER),
    "model.layers.0.self_attn.q_proj.bias",
]


@pytest.mark.parametrize("hf", HF_TENSORS)
def test_every_tensor_name_goes_to_gguf_and_back(hf):
    gguf = gguf_tensor_name(hf)
    assert gguf is not None and gguf != hf
    assert hf_tensor_name(gguf) == hf


def test_known_names_and_unknown_ones():
    assert gguf_tensor_name("model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q.weight"
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("blk.1.attn_q.scales") is None  # not a weight or a bias
    assert hf_tensor_name("rope_freqs.weight") is None
    assert gguf_tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert convert.checkpoint_gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    with pytest.raises(ValueError, match="unexpected tensor"):
        convert.checkpoint_gguf_name("model.layers.0.mystery.weight")


def test_architectures_read_back_as_the_architecture_that_wrote_them():
    for gguf, permuted in convert.ARCHITECTURES.values():
        back, back_permuted = GGUF_ARCHITECTURES[gguf]
        assert back_permuted == permuted
        assert convert.ARCHITECTURES[back] == (gguf, permuted)
    assert GGUF_ARCHITECTURES["llama"] == ("LlamaForCausalLM", True)  # Mistral writes llama too


# (heads, head_dim) of q and (KV heads) of k, as real checkpoints pair them
ROPE_SHAPES = [(1, 2, 1), (4, 8, 4), (6, 64, 2), (8, 16, 1), (12, 32, 4)]


@pytest.mark.parametrize(("heads", "head_dim", "kv_heads"), ROPE_SHAPES)
def test_the_rope_row_orders_are_inverse_on_q_and_k(heads, head_dim, kv_heads):
    rng = np.random.default_rng(heads * 1000 + head_dim)
    hidden = 24
    q = rng.standard_normal((heads * head_dim, hidden)).astype(np.float32)
    k = rng.standard_normal((kv_heads * head_dim, hidden)).astype(np.float32)
    bias = rng.standard_normal(kv_heads * head_dim).astype(np.float32)
    for weight, n in ((q, heads), (k, kv_heads), (bias, kv_heads)):
        interleaved = to_interleaved_rope(weight, n)
        if head_dim > 2:  # a head of one pair has nothing to reorder
            assert not np.array_equal(interleaved, weight)
        np.testing.assert_array_equal(from_interleaved_rope(interleaved, n), weight)
        back = to_interleaved_rope(from_interleaved_rope(weight, n), n)
        np.testing.assert_array_equal(back, weight)


def test_the_interleaved_order_pairs_each_heads_halves():
    # one head of dim 8: HF rows [a0 a1 a2 a3 | b0 b1 b2 b3] -> llama.cpp (a0 b0)(a1 b1)...
    assert interleaved_rope_rows(8, 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert interleaved_rope_rows(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError, match="heads"):
        interleaved_rope_rows(12, 4)  # heads of 3 rows hold no whole pairs


def test_only_q_and_k_projections_are_reordered():
    assert rope_heads("model.layers.2.self_attn.q_proj.weight", 6, 2) == 6
    assert rope_heads("model.layers.2.self_attn.k_proj.bias", 6, 2) == 2
    assert rope_heads("model.layers.2.self_attn.v_proj.weight", 6, 2) is None
    assert rope_heads("model.layers.2.self_attn.q_norm.weight", 6, 2) is None


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_the_demo_model_converts_and_loads_back_exactly(tmp_path, outtype):
    """convert.py's writer and gguf_weights.py's reader undo each other: every tensor of the
    (f16) demo checkpoint comes back bit for bit, q/k rows included (llama: permuted)."""
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert convert.ARCHITECTURES[config["architectures"][0]][1]  # the permuted case
    path = convert.convert_hf_to_gguf(DEMO_MODEL_DIR, tmp_path / "demo.gguf", outtype)
    meta = read_gguf_metadata(path)
    back = dict(gguf_tensors(meta, gguf_model_config(meta)))
    with safe_open(str(DEMO_MODEL_DIR / "model.safetensors"), framework="pt") as f:
        original = {name: f.get_tensor(name) for name in f.keys()}
    assert set(back) == set(original) - {"lm_head.weight"}  # tied: llama.cpp reuses the embedding
    for name, tensor in original.items():
        if name in back:
            assert torch.equal(back[name], tensor.float()), name
