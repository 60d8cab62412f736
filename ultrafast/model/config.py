"""ModelConfig: the architecture facts our Llama-family module needs, read from an HF config.json.

Owns the translation from the many spellings of Hugging Face configs (transformers 4 puts
`rope_theta` / `rope_scaling` at the top level, transformers 5 nests them in `rope_parameters`;
`torch_dtype` became `dtype`; Qwen2 derives sliding-window layers from `max_window_layers`) to
one frozen dataclass. Pure Python: no torch, no disk.
"""

from __future__ import annotations

from dataclasses import dataclass


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded, with a message that says what to fix. Defined
    here, below model/loader.py and quant/saved.py, so that both raise it without a cycle."""


@dataclass(frozen=True)
class ArchTraits:
    """What differs between the supported architectures; everything else is shared."""

    qkv_bias: bool | None  # True/False: fixed by the arch; None: the config's `attention_bias`
    o_bias_follows_flag: bool  # o_proj also has a bias when `attention_bias` is set
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE
    sliding_window: str  # "none", "all" (Mistral) or "layer_types" (Qwen2/3)


# HF architecture name -> traits. A literal table, not a registry.
ARCHITECTURES = {
    "LlamaForCausalLM": ArchTraits(None, True, False, "none"),
    "MistralForCausalLM": ArchTraits(False, False, False, "all"),
    "Qwen2ForCausalLM": ArchTraits(True, False, False, "layer_types"),
    "Qwen3ForCausalLM": ArchTraits(None, True, True, "layer_types"),
}
# configs without `architectures` still name their family in `model_type`
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency-band scaling of RoPE (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads: grouped-query attention
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None: plain RoPE ("default")
    max_position_embeddings: int
    tie_word_embeddings: bool  # lm_head shares embed_tokens' weight
    attention_bias: bool  # q/k/v projections carry biases (Qwen2 always; Llama/Qwen3 by flag)
    o_proj_bias: bool  # o_proj carries a bias (Llama/Qwen3 with attention_bias)
    mlp_bias: bool  # gate/up/down carry biases (Llama's mlp_bias)
    qk_norm: bool  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    layer_sliding_windows: tuple[int | None, ...]  # per layer: attend to the last N positions
    torch_dtype: str  # the checkpoint's dtype, e.g. "bfloat16"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # per-frequency divisors of RoPE's angle, as a GGUF stores them (its `rope_freqs` tensor for
    # Llama 3 scaling, or one factor for linear scaling); used instead of rope_scaling
    rope_freq_factors: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a parsed config.json; ValueError / KeyError name what is wrong."""
        arch = _architecture(hf)
        traits = ARCHITECTURES[arch]
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        hidden = int(hf["hidden_size"])
        flag = bool(hf.get("attention_bias") or False)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        theta, scaling = _rope(hf)
        num_layers = int(hf["num_hidden_layers"])
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=flag if traits.qkv_bias is None else traits.qkv_bias,
            o_proj_bias=flag and traits.o_bias_follows_flag,
            mlp_bias=bool(hf.get("mlp_bias") or False) and arch == "LlamaForCausalLM",
            qk_norm=traits.qk_norm,
            layer_sliding_windows=_sliding_windows(hf, traits.sliding_window, num_layers),
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head (1 for plain multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else MODEL_TYPES.get(hf.get("model_type", ""))
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 nests everything in rope_parameters; older configs use two keys
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling {rope_type!r} (supported: default, llama3)")
    return theta, RopeScaling(
        float(rope["factor"]),
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]),
    )


def _sliding_windows(hf: dict, rule: str, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if rule == "none" or not window:
        return (None,) * num_layers
    if rule == "all":
        return (int(window),) * num_layers
    # Qwen2/3: the window only applies with use_sliding_window, on the layers named sliding
    if not hf.get("use_sliding_window", False):
        return (None,) * num_layers
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= int(hf.get("max_window_layers", 0)) else "full_attention"
        for i in range(num_layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
