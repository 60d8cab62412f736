"""A GGUF's weights as the wide pass holds them (wide_forward.py): each decoder layer's
matrices fused where one GEMM can do two (q/k/v, gate/up) and packed for oneDNN
(packed_linear.weight), its norms in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ultrafast.executors.packed_linear import Weight, weight
from ultrafast.model.config import ModelConfig
from ultrafast.model.gguf_weights import gguf_tensors

BF16 = torch.bfloat16


GEMM_KINDS = ("qkv", "o", "gate_up", "down")  # a layer's matrices, by their field names


@dataclass
class Layer:
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    gate_up: Weight
    down: Weight
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def model_weights(meta, config: ModelConfig):
    """HF name -> tensor: matrices bf16, norm weights float32, one dequantized tensor at a time."""
    for name, tensor in gguf_tensors(meta, config):
        is_matrix = tensor.dim() == 2 and not name.endswith("embed_tokens.weight")
        yield name, tensor.to(BF16) if is_matrix else tensor


def layer_weights(tensors: dict[str, torch.Tensor], i: int) -> Layer:
    def take(name: str) -> torch.Tensor:
        return tensors.pop(f"model.layers.{i}.{name}")

    def maybe(name: str) -> torch.Tensor | None:
        return tensors.pop(f"model.layers.{i}.{name}", None)

    qkv = torch.cat([take(f"self_attn.{p}_proj.weight") for p in "qkv"]).contiguous()
    biases = [maybe(f"self_attn.{p}_proj.bias") for p in "qkv"]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b for b in biases if b is not None]).to(BF16)
    gate_up = torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]).contiguous()
    return Layer(  # the matrices packed for oneDNN where that works (packed_linear.py)
        qkv=weight(qkv),
        qkv_bias=bias,
        o=weight(take("self_attn.o_proj.weight").contiguous()),
        gate_up=weight(gate_up),
        down=weight(take("mlp.down_proj.weight").contiguous()),
        attn_norm=take("input_layernorm.weight").float(),
        ffn_norm=take("post_attention_layernorm.weight").float(),
        q_norm=maybe("self_attn.q_norm.weight"),
        k_norm=maybe("self_attn.k_norm.weight"),
    )
