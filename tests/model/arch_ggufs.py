"""Tiny random-weight GGUFs of architectures our torch model does not implement, written at test
time with the `gguf` package: llama.cpp's tensor names and metadata keys for each architecture,
and the demo model's byte-level BPE vocabulary and ChatML template copied from its GGUF.

The ggml executor runs any architecture llama.cpp runs; these files prove it for families
unlike Llama: gpt2 (learned positions, LayerNorm with biases, fused QKV, GELU) and starcoder2
(LayerNorm with biases, separate biased Q/K/V, RoPE, a GELU MLP without a gate).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ultrafast.config import DEMO_MODEL_DIR

EMBED, FFN, HEADS, KV_HEADS, LAYERS, CONTEXT = 64, 128, 4, 2, 2, 512
ARCHS = ("gpt2", "starcoder2")

_VOCAB_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def demo_gguf() -> Path:
    return next(DEMO_MODEL_DIR.glob("*.gguf"))


def _copy_vocab(writer, source: Path) -> int:
    """The source GGUF's tokenizer.* fields, value for value; returns the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    size = 0
    for key in _VOCAB_KEYS:
        field = reader.get_field(key)
        if field is None:
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            size = len(value)
    return size


def _normal(rng: np.random.Generator, *shape: int, scale: float) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _layer_norm(rng, add, name: str) -> None:
    add(f"{name}.weight", rng.uniform(0.5, 1.5, EMBED).astype(np.float32))
    add(f"{name}.bias", _normal(rng, EMBED, scale=0.1))


def _linear(rng, add, name: str, rows: int, cols: int, bias: bool = True) -> None:
    """numpy shape (out, in): ggml's {in, out}. Scaled so activations stay O(1)."""
    add(f"{name}.weight", _normal(rng, rows, cols, scale=1.0 / np.sqrt(cols)))
    if bias:
        add(f"{name}.bias", _normal(rng, rows, scale=0.1))


def _gpt2_tensors(rng, add, vocab: int) -> None:
    add("token_embd.weight", _normal(rng, vocab, EMBED, scale=1.0))
    add("position_embd.weight", _normal(rng, CONTEXT, EMBED, scale=0.3))
    for i in range(LAYERS):
        blk = f"blk.{i}"
        _layer_norm(rng, add, f"{blk}.attn_norm")
        _linear(rng, add, f"{blk}.attn_qkv", 3 * EMBED, EMBED)
        _linear(rng, add, f"{blk}.attn_output", EMBED, EMBED)
        _layer_norm(rng, add, f"{blk}.ffn_norm")
        _linear(rng, add, f"{blk}.ffn_up", FFN, EMBED)
        _linear(rng, add, f"{blk}.ffn_down", EMBED, FFN)
    _layer_norm(rng, add, "output_norm")
    _linear(rng, add, "output", vocab, EMBED, bias=False)  # untied: tied repeats the last token


def _starcoder2_tensors(rng, add, vocab: int) -> None:
    kv_width = EMBED // HEADS * KV_HEADS
    add("token_embd.weight", _normal(rng, vocab, EMBED, scale=1.0))
    for i in range(LAYERS):
        blk = f"blk.{i}"
        _layer_norm(rng, add, f"{blk}.attn_norm")
        _linear(rng, add, f"{blk}.attn_q", EMBED, EMBED)
        _linear(rng, add, f"{blk}.attn_k", kv_width, EMBED)
        _linear(rng, add, f"{blk}.attn_v", kv_width, EMBED)
        _linear(rng, add, f"{blk}.attn_output", EMBED, EMBED)
        _layer_norm(rng, add, f"{blk}.ffn_norm")
        _linear(rng, add, f"{blk}.ffn_up", FFN, EMBED)
        _linear(rng, add, f"{blk}.ffn_down", EMBED, FFN)
    _layer_norm(rng, add, "output_norm")
    _linear(rng, add, "output", vocab, EMBED, bias=False)


_SSM_INNER, _SSM_STATE, _SSM_CONV, _SSM_DT_RANK = 2 * EMBED, 16, 4, 8


def _mamba_tensors(rng, add, vocab: int) -> None:
    """A recurrent model: llama.cpp runs it, but its state cannot be cut back to a position."""
    add("token_embd.weight", _normal(rng, vocab, EMBED, scale=1.0))
    for i in range(LAYERS):
        blk = f"blk.{i}"
        add(f"{blk}.attn_norm.weight", np.ones(EMBED, dtype=np.float32))
        _linear(rng, add, f"{blk}.ssm_in", 2 * _SSM_INNER, EMBED, bias=False)
        _linear(rng, add, f"{blk}.ssm_conv1d", _SSM_INNER, _SSM_CONV)
        _linear(rng, add, f"{blk}.ssm_x", _SSM_DT_RANK + 2 * _SSM_STATE, _SSM_INNER, bias=False)
        _linear(rng, add, f"{blk}.ssm_dt", _SSM_INNER, _SSM_DT_RANK)
        add(f"{blk}.ssm_a", -np.ones((_SSM_INNER, _SSM_STATE), dtype=np.float32))
        add(f"{blk}.ssm_d", np.ones(_SSM_INNER, dtype=np.float32))
        _linear(rng, add, f"{blk}.ssm_out", EMBED, _SSM_INNER, bias=False)
    add("output_norm.weight", np.ones(EMBED, dtype=np.float32))


def _mamba_keys(writer) -> None:
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_ssm_conv_kernel(_SSM_CONV)
    writer.add_ssm_inner_size(_SSM_INNER)
    writer.add_ssm_state_size(_SSM_STATE)
    writer.add_ssm_time_step_rank(_SSM_DT_RANK)


def _gpt2_keys(writer) -> None:
    writer.add_layer_norm_eps(1e-5)


def _starcoder2_keys(writer) -> None:
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(EMBED // HEADS)


_BUILDERS: dict[str, tuple[Callable, Callable]] = {
    "gpt2": (_gpt2_keys, _gpt2_tensors),
    "starcoder2": (_starcoder2_keys, _starcoder2_tensors),
    "mamba": (_mamba_keys, _mamba_tensors),  # not in ARCHS: the executor refuses it
}


def write_arch_gguf(path: Path, arch: str, seed: int = 0, declare_as: str | None = None) -> Path:
    """A random-weight f32 GGUF of `arch` (one of ARCHS, or "mamba") with the demo model's
    vocabulary; `declare_as` names another architecture in its metadata (one llama.cpp does
    not know)."""
    import gguf

    add_keys, add_tensors = _BUILDERS[arch]
    writer = gguf.GGUFWriter(str(path), declare_as or arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBED)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_keys(writer)
    vocab = _copy_vocab(writer, demo_gguf())
    rng = np.random.default_rng(seed)
    add_tensors(rng, writer.add_tensor, vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
