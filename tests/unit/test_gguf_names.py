"""The HF <-> GGUF name tables are written once; the reader's direction is their inverse."""

import pytest

from ultrafast import convert
from ultrafast.model import gguf_names
from ultrafast.model.gguf_names import GGUF_ARCHITECTURES, gguf_tensor_name, hf_tensor_name

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
    assert convert._gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    with pytest.raises(ValueError, match="unexpected tensor"):
        convert._gguf_name("model.layers.0.mystery.weight")


def test_architectures_read_back_as_the_architecture_that_wrote_them():
    for gguf, permuted in convert.ARCHITECTURES.values():
        back, back_permuted = GGUF_ARCHITECTURES[gguf]
        assert back_permuted == permuted
        assert convert.ARCHITECTURES[back] == (gguf, permuted)
    assert GGUF_ARCHITECTURES["llama"] == ("LlamaForCausalLM", True)  # Mistral writes llama too
