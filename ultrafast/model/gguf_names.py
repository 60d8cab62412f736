"""HF <-> GGUF names and layouts: architectures, tensor names and the q/k RoPE row order,
each written once (HF -> GGUF).

convert.py and quant/gguf_export.py write GGUF files with the HF -> GGUF direction;
model/gguf_weights.py reads them back into our HF-named model with the reverse direction,
derived here from the same tables (and the same row order), so a tensor added to one direction
is known to the other.
"""

from __future__ import annotations

import numpy as np

# HF architecture -> (GGUF architecture, q/k rows permuted for interleaved rope)
HF_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
}
# GGUF architecture -> (HF architecture, permuted): the first HF name that writes it (a
# Mistral checkpoint converts to "llama" and reads back as Llama, the same model)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {}
for _hf, (_gguf, _permuted) in HF_ARCHITECTURES.items():
    GGUF_ARCHITECTURES.setdefault(_gguf, (_hf, _permuted))

# HF tensor stem -> GGUF tensor stem (the ".weight" / ".bias" suffix is kept)
_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
# the same inside each layer: model.layers.N.<HF> <-> blk.N.<GGUF>
_PER_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_BACK = {gguf: hf for hf, gguf in _GLOBAL.items()}
_PER_LAYER_BACK = {gguf: hf for hf, gguf in _PER_LAYER.items()}


def gguf_tensor_name(hf_name: str) -> str | None:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`; None if unknown."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    parts = stem.split(".")
    if stem.startswith("model.layers.") and ".".join(parts[3:]) in _PER_LAYER:
        return f"blk.{parts[2]}.{_PER_LAYER['.'.join(parts[3:])]}.{suffix}"
    return None


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_BACK:
        return f"{_GLOBAL_BACK[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _PER_LAYER_BACK:
        return f"model.layers.{parts[1]}.{_PER_LAYER_BACK[parts[2]]}.{suffix}"
    return None


# llama.cpp's "llama" arch rotates interleaved pairs (x0,x1),(x2,x3)... of each head; HF's Llama
# rotates halves (x_i, x_{i+d/2}). The architectures marked "permuted" above therefore store
# each head's q/k rows in the interleaved order, given by one index map used both ways.


def interleaved_rope_rows(rows: int, num_heads: int) -> np.ndarray:
    """Row i of a GGUF (interleaved) q/k projection is row `order[i]` of the HF (halves) one:
    per head, [first halves, second halves] -> (first_0, second_0, first_1, second_1, ...)."""
    if num_heads <= 0 or rows % (2 * num_heads):
        raise ValueError(f"{rows} q/k rows do not split into {num_heads} heads of pairs")
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, 2, half).swapaxes(1, 2).reshape(rows)


def rope_heads(hf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads' rows the HF tensor `hf_name` holds when it is a q (num_heads) or k
    (num_kv_heads) projection, whose rows the permuted architectures reorder; else None."""
    stem = hf_name.rpartition(".")[0]
    if stem.endswith(".self_attn.q_proj"):
        return num_heads
    if stem.endswith(".self_attn.k_proj"):
        return num_kv_heads
    return None


def to_interleaved_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF -> GGUF: a q or k projection's rows (weight or bias) in llama.cpp's interleaved order."""
    return weight[interleaved_rope_rows(weight.shape[0], num_heads)]


def from_interleaved_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """GGUF -> HF: the inverse of `to_interleaved_rope`, the layout HF's rotate_half expects."""
    out = np.empty_like(weight)
    out[interleaved_rope_rows(weight.shape[0], num_heads)] = weight
    return out
