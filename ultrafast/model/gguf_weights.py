"""Load a GGUF file into our PyTorch model: dequantize every tensor, rename it to the Hugging Face
parameter it came from, and read the ModelConfig from the file's metadata.

Why: the torch executor (the reference path and the GPU path) then serves the very files the
ggml executor serves. Only the architectures our model implements are accepted (llama, which
also carries Mistral, and qwen2 / qwen3); anything else is refused with a ModelLoadError that
points at `--executor ggml`, which runs every architecture llama.cpp knows.

Layout facts the mapping undoes:
- llama.cpp's "llama" arch rotates interleaved pairs (x0,x1),(x2,x3)... while HF's Llama rotates
  halves (x_i, x_{i+d/2}); converters therefore permute each head's rows of attn_q / attn_k, and
  we put them back (both directions: model/gguf_names.py). qwen2/qwen3 use halves ("NEOX")
  rope in llama.cpp too: no permutation.
- A GGUF holds shapes innermost-first (ggml's ne order); numpy's shape is the reverse.
- No `output.weight`: the embeddings are tied (llama.cpp reuses token_embd).
- Llama 3 rope scaling is stored as `rope_freqs.weight`, per-frequency divisors of the angle.
Quantized tensors are dequantized with the `gguf` package's numpy kernels, one tensor at a time,
so host memory peaks at one float32 tensor beside the model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ultrafast.model.config import ModelConfig, ModelLoadError
from ultrafast.model.dtypes import resolve_dtype
from ultrafast.model.gguf_meta import GgufMetadata, TensorInfo, read_gguf_metadata, tensor_nbytes
from ultrafast.model.gguf_names import (
    GGUF_ARCHITECTURES,
    from_interleaved_rope,
    hf_tensor_name,
    rope_heads,
)
from ultrafast.model.llama import LlamaForCausalLM

# general.file_type -> the checkpoint dtype `--dtype auto` picks (quantized files: float32)
_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
_ROPE_FREQS = "rope_freqs.weight"


def _refuse(meta: GgufMetadata, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{meta.path}: the torch executor cannot run this model ({what}); "
        "serve it with --executor ggml, which runs the file as it is"
    )


def _int_value(meta: GgufMetadata, name: str, default: int | None = None) -> int:
    value = meta.arch_value(name, default)
    if isinstance(value, list):  # per-layer values (e.g. head_count_kv of hybrid models)
        if len(set(value)) != 1:
            raise _refuse(meta, f"{meta.architecture}.{name} differs between layers: {value}")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"{meta.path}: {meta.architecture}.{name} is missing or invalid")
    return value


def _f32_decimal(value: float) -> float:
    """GGUF stores floats as float32; 1e-5 arrives as 9.99999997e-06. Take the shortest
    decimal that is the same float32, as the original config wrote it."""
    return float(str(np.float32(value)))


def _rope_freq_factors(meta: GgufMetadata, half_dim: int) -> tuple[float, ...] | None:
    scaling = meta.arch_value("rope.scaling.type", "none")
    factors = None
    if scaling == "linear":  # positions divided by `factor`: the same for every frequency
        factor = float(meta.arch_value("rope.scaling.factor", 1.0))
        factors = (factor,) * half_dim
    elif scaling not in ("none", None):
        raise _refuse(meta, f"rope scaling {scaling!r}")
    if any(t.name == _ROPE_FREQS for t in meta.tensors):
        info = next(t for t in meta.tensors if t.name == _ROPE_FREQS)
        values = _dequantize(meta, info).reshape(-1)
        if values.size != half_dim:
            raise ModelLoadError(
                f"{meta.path}: {_ROPE_FREQS} has {values.size} values, expected {half_dim}"
            )
        freqs = tuple(float(v) for v in values)
        factors = freqs if factors is None else tuple(a * b for a, b in zip(factors, freqs))
    return factors


def _has(meta: GgufMetadata, name: str) -> bool:
    return any(t.name == name for t in meta.tensors)


def gguf_model_config(meta: GgufMetadata) -> ModelConfig:
    """The ModelConfig a GGUF's metadata and tensor table describe; ModelLoadError if our model
    cannot run it."""
    arch = meta.architecture
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise _refuse(meta, f"architecture {arch!r}; it runs {supported}")
    if meta.arch_value("expert_count", 0):
        raise _refuse(meta, f"a mixture of {meta.arch_value('expert_count')} experts")
    embed = next((t for t in meta.tensors if t.name == "token_embd.weight"), None)
    if embed is None or len(embed.shape) != 2:
        raise ModelLoadError(f"{meta.path} has no 2-D token_embd.weight tensor")
    hidden, vocab_size = embed.shape  # ne order: innermost (hidden) first
    if _int_value(meta, "embedding_length") != hidden:
        raise ModelLoadError(f"{meta.path}: token_embd.weight does not match embedding_length")
    heads = _int_value(meta, "attention.head_count")
    kv_heads = _int_value(meta, "attention.head_count_kv", heads)
    if heads % kv_heads:
        raise ModelLoadError(f"{meta.path}: {heads} heads is not a multiple of {kv_heads} KV heads")
    head_dim = _int_value(meta, "attention.key_length", hidden // heads)
    if _int_value(meta, "attention.value_length", head_dim) != head_dim:
        raise _refuse(meta, "value heads of another size than key heads")
    if _int_value(meta, "rope.dimension_count", head_dim) != head_dim:
        raise _refuse(meta, "RoPE on part of each head only")
    if meta.arch_value("attention.sliding_window"):
        raise _refuse(meta, "sliding-window attention")
    layers = _int_value(meta, "block_count")
    context = meta.arch_value("context_length")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch][0],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_int_value(meta, "feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32_decimal(meta.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32_decimal(meta.arch_value("rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=context if isinstance(context, int) and context > 0 else 2048,
        tie_word_embeddings=not _has(meta, "output.weight"),
        attention_bias=_has(meta, "blk.0.attn_q.bias"),
        o_proj_bias=_has(meta, "blk.0.attn_output.bias"),
        mlp_bias=_has(meta, "blk.0.ffn_up.bias"),
        qk_norm=_has(meta, "blk.0.attn_q_norm.weight"),
        layer_sliding_windows=(None,) * layers,
        torch_dtype=_FILE_TYPE_DTYPES.get(meta.get("general.file_type"), "float32"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if isinstance(eos, int) else (),
        rope_freq_factors=_rope_freq_factors(meta, head_dim // 2),
    )


def _dequantize(meta: GgufMetadata, info: TensorInfo) -> np.ndarray:
    """One tensor as float32 in numpy's shape (ne order reversed)."""
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise ModelLoadError(
            f"tensor {info.name!r} has unknown ggml type {info.ggml_type}"
        ) from None
    shape = tuple(reversed(info.shape))
    start = meta.data_offset + info.offset
    raw = np.memmap(meta.path, dtype=np.uint8, mode="r", offset=start, shape=(tensor_nbytes(info),))
    try:
        data = gguf.quants.dequantize(
            raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype)), qtype
        )
    except NotImplementedError:
        raise ModelLoadError(
            f"{meta.path}: tensor {info.name!r} is {qtype.name}, which cannot be dequantized "
            "here; serve this file with --executor ggml"
        ) from None
    data = data.reshape(shape).astype(np.float32, copy=False)
    return data if data.flags.writeable else data.copy()  # a view of the read-only map


def gguf_tensor(meta: GgufMetadata, name: str) -> np.ndarray:
    """The tensor `name` as float32 in numpy's shape (the torch embedding pass reads its
    encoder this way); a KeyError names a tensor the file does not hold."""
    info = next((info for info in meta.tensors if info.name == name), None)
    if info is None:
        raise KeyError(f"{meta.path} holds no tensor {name!r}")
    return _dequantize(meta, info)


def gguf_tensors(meta: GgufMetadata, config: ModelConfig):
    """Yield (HF parameter name, float32 torch tensor in HF layout) for every weight."""
    permute = GGUF_ARCHITECTURES[meta.architecture][1]
    for info in meta.tensors:
        if info.name == _ROPE_FREQS:
            continue  # already in config.rope_freq_factors
        name = hf_tensor_name(info.name)
        if name is None:
            raise _refuse(meta, f"tensor {info.name!r} has no place in it")
        data = _dequantize(meta, info)
        heads = rope_heads(name, config.num_attention_heads, config.num_key_value_heads)
        if permute and heads is not None:
            data = from_interleaved_rope(data, heads)
        yield name, torch.from_numpy(data)


def load_gguf_model(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The GGUF's model dequantized, in eval mode on `device`; dtype None = float32 on CPU,
    bfloat16 elsewhere ("auto": float16/bfloat16 for such files, else float32)."""
    meta = read_gguf_metadata(path)  # truncated or corrupt files are refused here
    config = gguf_model_config(meta)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device, config.torch_dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in gguf_tensors(meta, config):
        if name not in expected:
            raise _refuse(meta, f"a tensor for {name!r}, which it has no place for")
        if tensor.shape != expected[name]:
            raise ModelLoadError(
                f"{meta.path}: tensor for {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(expected[name])} from the file's metadata"
            )
        loaded[name] = tensor.to(device=device, dtype=torch_dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        raise ModelLoadError(f"{meta.path} is missing {len(missing)} tensors: {shown}")
    model.load_state_dict(loaded, strict=False, assign=True)
    model.tie_weights()
    model.requires_grad_(False)
    model.set_max_positions(model.max_positions)
    return model.eval(), config
