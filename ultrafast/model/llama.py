"""One plain nn.Module for the Llama family: Llama 2/3 (incl. Llama-3 RoPE scaling), Mistral,
Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm); GQA; tied or untied embeddings.

The model knows nothing about requests or KV layout: tokens of several sequences arrive
flattened as [T], each with its position, and every attention layer hands its q/k/v to an
attention backend (`attn(layer_idx, q, k, v) -> out`) that owns the KV cache. Parameter names
match Hugging Face checkpoints, so safetensors load without renaming.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ultrafast.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()  # normalise in float32 and cast back before the weight, as HF does
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32 on the CPU, with Llama-3 band scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_freq_factors is not None:  # a GGUF's precomputed divisors
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32, device="cpu")
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated, so the model's original context keeps its resolution
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(config: ModelConfig, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [num_positions, head_dim] in float32 (CPU), computed as HF computes them."""
    positions = torch.arange(num_positions, dtype=torch.float32, device="cpu")
    freqs = positions[:, None] * rope_inv_freq(config)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, config.hidden_size, bias=config.o_proj_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3 normalises each head before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """`model(input_ids[T], positions[T], attn) -> hidden[T, hidden]`; `compute_logits(rows)`."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.max_positions = max_positions or config.max_position_embeddings
        cos, sin = rope_tables(config, self.max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """Point lm_head at embed_tokens when the config ties them (again after to_empty/assign)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_max_positions(self, num_positions: int) -> None:
        """Rebuild the RoPE tables for positions [0, num_positions), on the model's device.

        Computed in float32 and cast once to the weights' dtype, which is exactly what HF does
        per call; sizing them to the executor's max_model_len keeps a 128k-context config from
        holding tables it never reads.
        """
        weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(self.config, num_positions)
        self.rope_cos = cos.to(device=weight.device, dtype=weight.dtype)
        self.rope_sin = sin.to(device=weight.device, dtype=weight.dtype)
        self.max_positions = num_positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions: [T]; returns the final-normed hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype)[:, None, :]  # [T, 1, head_dim]
        sin = self.rope_sin[positions].to(x.dtype)[:, None, :]
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32 (the sampler's dtype)."""
        return self.lm_head(hidden).float()
