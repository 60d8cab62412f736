"""The memory-bandwidth roofline of batch-1 decode: bytes read per token / measured bandwidth.

At batch 1 every decoded token reads every weight once (tied embeddings: the shared matrix
once, as the LM head; the embedding lookup reads one row) plus the KV of the context so far,
so `bandwidth / bytes_per_token` is the most tokens/s the memory system allows. Bandwidth is
measured, not looked up: a reduction over a buffer much larger than the last-level cache, best
of a few passes (a read-only stream, which is what decode is).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

# bytes per weight of the GGUF types our ggml runners use (block scales included)
GGUF_BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@dataclass
class Roofline:
    weight_bytes: int  # read once per decoded token
    kv_bytes_per_position: int  # K and V over all layers, one position
    mean_context_tokens: float  # average positions attended per decoded token
    bytes_per_token: float
    bandwidth_gb_s: float  # measured, 1e9 bytes/s
    roofline_tok_s: float

    def fraction(self, tok_s: float) -> float:
        return tok_s / self.roofline_tok_s

    def as_dict(self) -> dict:
        return asdict(self)


def count_weight_params(config) -> int:
    """Parameters of a ModelConfig's Llama, counting a tied embedding matrix once."""
    h, kv_dim = config.hidden_size, config.num_key_value_heads * config.head_dim
    q_dim = config.num_attention_heads * config.head_dim
    per_layer = (
        h * q_dim
        + 2 * h * kv_dim
        + q_dim * h  # q, k, v, o
        + 3 * h * config.intermediate_size
        + 2 * h
    )  # gate, up, down; two norms
    if config.attention_bias:
        per_layer += q_dim + 2 * kv_dim
    embed = config.vocab_size * h
    head = 0 if config.tie_word_embeddings else embed
    return config.num_hidden_layers * per_layer + embed + head + h  # + final norm


def kv_bytes_per_position(config, kv_bytes_per_value: float) -> int:
    return int(
        2
        * config.num_hidden_layers
        * config.num_key_value_heads
        * config.head_dim
        * kv_bytes_per_value
    )


def measure_bandwidth_gb_s(
    num_bytes: int | None = None, passes: int = 5, device: str = "cpu"
) -> float:
    """Read bandwidth: sum a float32 buffer of num_bytes, best of `passes`.

    Default size: 512 MiB on the CPU, 4 GiB on a GPU: far beyond any cache (H200 L2: 60 MiB).
    """
    import torch

    num_bytes = num_bytes or (512 << 20 if device == "cpu" else 4 << 30)
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    best_s = float("inf")
    for _ in range(passes + 1):  # the first pass faults the pages in
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.sum()
        if device != "cpu":
            torch.cuda.synchronize()
        best_s = min(best_s, time.perf_counter() - t0)
    del x
    return num_bytes / best_s / 1e9


def roofline(
    weight_bytes: int, kv_bytes_per_pos: int, mean_context_tokens: float, bandwidth_gb_s: float
) -> Roofline:
    per_token = weight_bytes + kv_bytes_per_pos * mean_context_tokens
    return Roofline(
        weight_bytes,
        kv_bytes_per_pos,
        mean_context_tokens,
        per_token,
        bandwidth_gb_s,
        bandwidth_gb_s * 1e9 / per_token,
    )
