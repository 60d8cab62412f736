"""Offline conversion of a Hugging Face Llama-family checkpoint into a GGUF file for llama.cpp.

Owns the mapping from HF names/layouts/hyperparameters to llama.cpp's (the `ggml` executor loads
the result). Supported: Llama and Mistral (gguf arch "llama"), Qwen2 ("qwen2"), Qwen3 ("qwen3").
Byte-level BPE tokenizers only (Llama-3, Qwen, Mistral-Nemo style); sentencepiece ones are refused.

Choices worth knowing:
- llama.cpp's "llama" arch applies RoPE to interleaved pairs (x0,x1),(x2,x3)...; HF rotates halves
  (x_i, x_{i+d/2}). So q_proj/k_proj rows are permuted per head; qwen2/qwen3 use NEOX (halves) rope
  in llama.cpp and are written unpermuted.
- Tied embeddings: no `output.weight` is written; llama.cpp then reuses `token_embd.weight`
  (smaller file, same math).
- Llama-3 rope scaling is written as a `rope_freqs` tensor of per-dimension divisors, which is how
  llama.cpp consumes it.
- Mistral's sliding window is not represented (llama.cpp's llama arch has none); fine up to the
  window length, which is all the checkpoints in use need.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from ultrafast.model.config import MODEL_TYPES  # configs naming only their model_type
from ultrafast.model.gguf_names import (
    HF_ARCHITECTURES,
    gguf_tensor_name,
    rope_heads,
    to_interleaved_rope,
)
from ultrafast.weight_format import AUTO, resolve_outtype

# HF architecture -> (gguf arch, permute q/k for interleaved rope); tensor names: gguf_names.py
ARCHITECTURES = HF_ARCHITECTURES

_OUT_TYPES = {  # outtype -> (ggml tensor type for 2-D weights, gguf file type)
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
# tokenizer.json pre-tokenizer regex fragment -> llama.cpp pre-tokenizer name
_PRE_TOKENIZERS = [("\\p{N}{1,3}", "llama-bpe"), ("|\\p{N}|", "qwen2")]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} not found in {path.parent}")
    return json.loads(path.read_text(encoding="utf-8"))


def _architecture(config: dict) -> str:
    names = config.get("architectures") or [MODEL_TYPES.get(config.get("model_type", ""), "?")]
    if names[0] not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {names[0]!r}; supported: {sorted(ARCHITECTURES)}"
        )
    return names[0]


def _rope_params(config: dict) -> dict:
    """Transformers >= 5 nests rope settings in `rope_parameters`; older configs use two keys."""
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def llama3_rope_factors(config: dict) -> np.ndarray:
    """Per-frequency divisors of the rotation angle, equal to HF's llama3 inv_freq rescaling."""
    rope, head_dim = _rope_params(config), _head_dim(config)
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
    # smooth == 0 (long wavelengths): divide by `factor`; smooth == 1 (short): leave alone
    return (1.0 / ((1.0 - smooth) / factor + smooth)).astype(np.float32)


def gguf_layout_tensors(model_dir: Path, config: dict) -> Iterator[tuple[str, str, np.ndarray]]:
    """(GGUF name, HF name, float32 data in GGUF's layout) for each tensor a GGUF of the
    checkpoint holds: q/k rows interleaved where the architecture rotates pairs
    (model/gguf_names.py), a tied checkpoint's lm_head left out (llama.cpp reuses token_embd).
    The converter and quant/gguf_export.py both write these."""
    _, permute = ARCHITECTURES[_architecture(config)]
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    tied = config.get("tie_word_embeddings", False)
    for hf_name, tensor in _hf_tensors(model_dir):
        name = checkpoint_gguf_name(hf_name)
        if name is None or (tied and name == "output.weight"):
            continue
        data = tensor.to(torch.float32).numpy()
        heads = rope_heads(hf_name, num_heads, num_kv_heads) if permute else None
        yield name, hf_name, data if heads is None else to_interleaved_rope(data, heads)


def checkpoint_gguf_name(hf_name: str) -> str | None:
    """The GGUF name of a checkpoint tensor; None for what is not written (rotary inv_freq
    buffers, recomputed by llama.cpp); ValueError for a tensor no table knows."""
    name = gguf_tensor_name(hf_name)
    if name is not None:
        return name
    if hf_name.rpartition(".")[0].endswith("rotary_emb"):
        return None  # inv_freq buffers are recomputed by llama.cpp
    raise ValueError(f"unexpected tensor {hf_name!r}")


def _hf_tensors(model_dir: Path):
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:  # torch reads bf16, numpy cannot
            for name in f.keys():
                yield name, f.get_tensor(name)


def _encode(
    data: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """(array, raw_dtype for GGUFWriter.add_tensor). 1-D tensors (norms, biases) stay f32."""
    if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        return data.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16), None
    if qtype == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32:
        return data.astype(np.float16), None  # q8_0 needs rows in blocks of 32
    return gguf.quants.quantize(data, qtype), qtype


def _write_hparams(writer: gguf.GGUFWriter, config: dict, name: str) -> None:
    rope = _rope_params(config)
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope["rope_type"] not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope['rope_type']!r}")


def _token_text(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config: dict) -> None:
    tok_json = _read_json(model_dir / "tokenizer.json")
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    model = tok_json.get("model", {})
    byte_level = "ByteLevel" in json.dumps([tok_json.get("pre_tokenizer"), tok_json.get("decoder")])
    if model.get("type") != "BPE" or not byte_level:
        raise ValueError("only byte-level BPE tokenizers are supported (no sentencepiece)")
    vocab = dict(model["vocab"])
    special = set()
    for added in tok_json.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    size = max(config["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, token_id in vocab.items():
        tokens[token_id] = text
        types[token_id] = gguf.TokenType.NORMAL
    user_defined = {a["id"] for a in tok_json.get("added_tokens", []) if not a.get("special")}
    for token_id in special | user_defined:
        types[token_id] = (
            gguf.TokenType.CONTROL if token_id in special else gguf.TokenType.USER_DEFINED
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre_json = json.dumps(tok_json.get("pre_tokenizer"))
    pre = next((n for frag, n in _PRE_TOKENIZERS if json.dumps(frag)[1:-1] in pre_json), None)
    if pre is None:  # GPT-2's regex; SmolLM/StarCoder first split every digit apart
        pre = "smollm" if '"individual_digits": true' in pre_json else "gpt-2"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        token_id = vocab.get(_token_text(tok_config.get(key)) or "")
        if token_id is None and isinstance(config.get(f"{key}_id"), int):
            token_id = config[f"{key}_id"]
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(
        bool(tok_config.get("add_bos_token", _post_processor_adds_bos(tok_json)))
    )
    template = tok_config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if template is not None:
        writer.add_chat_template(template)


def _post_processor_adds_bos(tok_json: dict) -> bool:
    """Llama-3 adds <|begin_of_text|> through a TemplateProcessing post-processor, not a flag."""
    text = json.dumps(tok_json.get("post_processor"))
    return '"SpecialToken"' in text and '"single"' in text


def convert_hf_to_gguf(model_dir: str | Path, out_path: str | Path, outtype: str = "f16") -> Path:
    """Convert a HF checkpoint directory into one GGUF file at `out_path`; returns the path.
    outtype "auto" is the per-CPU rule of ultrafast/weight_format.py."""
    model_dir, out_path = Path(model_dir), Path(out_path)
    if outtype == AUTO:
        outtype, _ = resolve_outtype(outtype)
    if outtype not in _OUT_TYPES:
        raise ValueError(f"unsupported outtype {outtype!r}; choose from {sorted(_OUT_TYPES)}")
    if (model_dir / "quantization.json").is_file():
        raise ValueError(
            f"{model_dir} holds torch-quantized weights; make its GGUF from the "
            "full-precision model with `ultrafast quantize --format gguf`"
        )
    config = _read_json(model_dir / "config.json")
    qtype, file_type = _OUT_TYPES[outtype]
    tied = config.get("tie_word_embeddings", False)
    writer = gguf_writer(model_dir, config, out_path, file_type)
    seen = set()
    for name, _, data in gguf_layout_tensors(model_dir, config):
        array, raw_dtype = _encode(data, qtype)
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
        seen.add(name)
    if "token_embd.weight" not in seen or (not tied and "output.weight" not in seen):
        raise ValueError(f"{model_dir}: missing embedding or lm_head weights")
    finish_gguf(writer)
    return out_path


def gguf_writer(
    model_dir: Path, config: dict, out_path: Path, file_type: gguf.LlamaFileType
) -> gguf.GGUFWriter:
    """A GGUF writer at `out_path` holding the checkpoint's metadata, tokenizer and (Llama 3
    rope scaling) rope_freqs, ready for its weights; the converter and quant/gguf_export.py
    add them (gguf_layout_tensors) and call finish_gguf."""
    arch, _ = ARCHITECTURES[_architecture(config)]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out_path, arch, use_temp_file=True)  # bounded memory on big models
    _write_hparams(writer, config, model_dir.name)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(writer, model_dir, config)
    if arch == "llama" and _rope_params(config)["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    return writer


def finish_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
