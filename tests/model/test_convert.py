"""HF -> GGUF conversion (ultrafast.convert): metadata, tokenizer and logits against transformers.

llama.cpp is driven here through llama-cpp-python's high-level `Llama` (not our executor), so a
failure points at the converter alone. An f32 GGUF with an f32 KV cache must reproduce HF's
logits to ~1e-5; that only holds if the q/k permutation, rope base/scaling, norms, biases and
head layout are all right.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from ultrafast.convert import convert_hf_to_gguf  # noqa: E402
from ultrafast.executors.llama_cpp_params import open_llama  # noqa: E402

PROMPT = [5, 17, 99, 200, 3, 45, 67, 300, 12, 8] * 8  # 80 positions: past rope's original ctx


def _llama(path, **kwargs):
    return open_llama(
        str(path),
        n_ctx=256,
        n_threads=2,
        verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        **kwargs,
    )


def _llama_cpp_logits(path, token_ids) -> torch.Tensor:
    llm = _llama(path, logits_all=True)
    try:
        llm.eval(token_ids)
        return torch.from_numpy(np.array(llm.scores[: len(token_ids)]))
    finally:
        llm.close()


def _hf_logits(hf_model, token_ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "llama3_rope", "qwen2", "qwen3"])
def test_f32_logits_match_transformers(kind, make_tiny_gguf, tiny_hf_model_factory):
    ours = _llama_cpp_logits(make_tiny_gguf(kind, "f32"), PROMPT)
    ref = _hf_logits(tiny_hf_model_factory(kind), PROMPT)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-3


def test_llama3_rope_scaling_changes_logits(tiny_hf_model_factory):
    """Same seed, same weights: the llama3 test above only means something if scaling matters."""
    plain = _hf_logits(tiny_hf_model_factory("llama"), PROMPT)
    scaled = _hf_logits(tiny_hf_model_factory("llama3_rope"), PROMPT)
    assert (plain - scaled).abs().max().item() > 1e-2


def test_metadata_matches_config(tiny_llama_dir, tiny_llama_gguf_f32, tiny_tokenizer_info):
    info = tiny_tokenizer_info
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    llm = _llama(tiny_llama_gguf_f32, vocab_only=True)
    meta = llm.metadata
    llm.close()
    assert meta["general.architecture"] == "llama"
    expected = {
        "llama.context_length": config["max_position_embeddings"],
        "llama.embedding_length": config["hidden_size"],
        "llama.block_count": config["num_hidden_layers"],
        "llama.feed_forward_length": config["intermediate_size"],
        "llama.attention.head_count": config["num_attention_heads"],
        "llama.attention.head_count_kv": config["num_key_value_heads"],
        "llama.attention.key_length": config["head_dim"],
        "llama.attention.value_length": config["head_dim"],
        "llama.rope.dimension_count": config["head_dim"],
        "llama.vocab_size": config["vocab_size"],
        "tokenizer.ggml.bos_token_id": info["bos_id"],
        "tokenizer.ggml.eos_token_id": info["eos_id"],
    }
    assert {k: int(meta[k]) for k in expected} == expected
    assert float(meta["llama.rope.freq_base"]) == pytest.approx(20000.0)
    assert float(meta["llama.attention.layer_norm_rms_epsilon"]) == pytest.approx(1e-5)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.chat_template"] == info["chat_template"]

    reader = gguf.GGUFReader(tiny_llama_gguf_f32)
    types = reader.fields["tokenizer.ggml.token_type"]
    token_types = [int(types.parts[i][0]) for i in types.data]
    num_special = len(info["special_tokens"])
    assert token_types[:num_special] == [gguf.TokenType.CONTROL] * num_special
    assert token_types[num_special:] == [gguf.TokenType.NORMAL] * (
        config["vocab_size"] - num_special
    )


def test_tokenizer_matches_hf_tokenizers(tiny_llama_dir, tiny_llama_gguf_f32, tiny_tokenizer_info):
    from tokenizers import Tokenizer

    hf_tok = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    llm = _llama(tiny_llama_gguf_f32, vocab_only=True)
    try:
        for text in [
            "Hello world! How are you?",
            "def add(a, b):\n    return a + b",
            "émojis 🚀 and  spaces\t42 1000",
            "unseen Zebra words qq",
        ]:
            expected = hf_tok.encode(text, add_special_tokens=False).ids
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == expected
        # BOS comes from the tokenizer's post-processor; the GGUF must say add_bos_token = true
        assert (
            llm.tokenize(b"Hello", add_bos=True, special=False)[0] == tiny_tokenizer_info["bos_id"]
        )
    finally:
        llm.close()


def test_q8_0_close_to_f32(make_tiny_gguf):
    f32_path, q8_path = make_tiny_gguf("llama", "f32"), make_tiny_gguf("llama", "q8_0")
    assert q8_path.stat().st_size < 0.5 * f32_path.stat().st_size
    full, quant = _llama_cpp_logits(f32_path, PROMPT), _llama_cpp_logits(q8_path, PROMPT)
    assert (full - quant).abs().max().item() < 0.5  # logits std is ~1.2
    agree = (full.argmax(-1) == quant.argmax(-1)).float().mean().item()
    assert agree >= 0.85


@pytest.mark.parametrize("outtype, ggml_type", [("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0")])
def test_outtypes_keep_1d_tensors_f32(outtype, ggml_type, make_tiny_gguf):
    path = make_tiny_gguf("qwen2", outtype)
    for tensor in gguf.GGUFReader(path).tensors:
        expected = "F32" if len(tensor.shape) == 1 else ggml_type
        assert tensor.tensor_type.name == expected, tensor.name
    llm = _llama(path)  # and llama.cpp accepts the file
    llm.close()


def test_tied_embeddings_write_no_output_tensor(make_tiny_gguf):
    names = {t.name for t in gguf.GGUFReader(make_tiny_gguf("llama_tied", "f32")).tensors}
    assert "token_embd.weight" in names and "output.weight" not in names


def test_llama3_rope_freqs_tensor(make_tiny_gguf):
    tensors = {t.name: t for t in gguf.GGUFReader(make_tiny_gguf("llama3_rope", "f32")).tensors}
    factors = np.array(tensors["rope_freqs.weight"].data)
    assert factors.shape == (8,)  # head_dim / 2
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(8.0)


def test_errors(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="outtype"):
        convert_hf_to_gguf(tiny_llama_dir, tmp_path / "x.gguf", "q4_k")
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")

    other = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        convert_hf_to_gguf(other, tmp_path / "x.gguf")

    no_tokenizer = tmp_path / "no_tok"
    shutil.copytree(tiny_llama_dir, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        convert_hf_to_gguf(no_tokenizer, tmp_path / "x.gguf")
