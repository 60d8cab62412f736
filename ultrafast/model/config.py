"""ModelConfig: the architecture facts our Llama-family module needs, read from HF config.json."""

from __future__ import annotations

from dataclasses import dataclass

# HF architecture name -> (q/k/v bias, per-head q/k RMSNorm). A literal table, not a registry.
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None  # ("llama3", factor, low_freq_factor, high_freq_factor, orig_len)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry biases (Qwen2, or Llama's attention_bias)
    qk_norm: bool  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(ARCHITECTURES)}")
        default_bias, qk_norm = ARCHITECTURES[arch]
        heads = hf["num_attention_heads"]
        # transformers >= 5 nests rope settings under rope_parameters; older configs use two keys
        rope = dict(hf.get("rope_scaling") or {})
        rope.update(hf.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = ("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                       float(rope["high_freq_factor"]),
                       int(rope["original_max_position_embeddings"]))
        elif rope_type in (None, "default"):
            scaling = None
        else:
            raise ValueError(f"unsupported rope scaling {rope_type!r} (supported: default, llama3)")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", default_bias)) or default_bias,
            qk_norm=qk_norm, torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids)
