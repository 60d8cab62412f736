"""A BERT encoder pass in PyTorch over the GGUF's own tensors: the other embedding path.

Why: llama.cpp runs f32 (or its quantized) GEMMs on its own kernels; PyTorch runs them through
oneDNN, which on CPUs with AMX does bf16 GEMMs several times faster (MiniLM, 32 inputs, one
thread: ~4x ggml's embeddings per CPU-second). Which path serves a model is decided by timing
both at start (executors/embed_choice.py), never by the CPU's name.

The same file, the same weights: every tensor is read from the GGUF (dequantized to f32 if it
is quantized) and, for bf16, cast once. Tokenizing stays with llama.cpp's vocabulary (the ggml
executor this one wraps), so both paths see the same token ids. Residuals and LayerNorms run
in f32 in both dtypes; only the GEMMs and the attention take the bf16 inputs.

The pass pads its inputs to the longest one and masks the padding in attention and pooling
(mean over the input's own tokens, CLS = its first, last = its last), then L2-normalises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ultrafast.model.gguf_meta import GgufMetadata, read_gguf_metadata
from ultrafast.model.gguf_weights import gguf_tensor

DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}
ARCHITECTURES = ("bert",)  # what this forward implements; others stay on llama.cpp
_LAYER_TENSORS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_output_norm",
    "ffn_up",
    "ffn_down",
    "layer_output_norm",
)


@dataclass
class _Layer:
    weights: dict[str, torch.Tensor]  # "<tensor>.weight" / "<tensor>.bias"


class BertWeights:
    """The encoder's tensors from a GGUF, GEMM weights in `dtype`, norms and embeddings f32."""

    def __init__(self, meta: GgufMetadata, dtype: torch.dtype):
        if meta.architecture not in ARCHITECTURES:
            raise ValueError(f"no PyTorch embedding pass for architecture {meta.architecture!r}")
        self.dtype = dtype
        self.num_heads = int(meta.arch_value("attention.head_count"))
        self.eps = float(meta.arch_value("attention.layer_norm_epsilon", 1e-12))
        names = {info.name for info in meta.tensors}

        def f32(name: str) -> torch.Tensor:
            return torch.from_numpy(gguf_tensor(meta, name))

        self.token_embd = f32("token_embd.weight")
        self.position_embd = f32("position_embd.weight")
        types = f32("token_types.weight")[0] if "token_types.weight" in names else None
        self.token_type0 = types
        self.embd_norm = (f32("token_embd_norm.weight"), f32("token_embd_norm.bias"))
        self.layers = []
        for i in range(int(meta.arch_value("block_count"))):
            weights = {}
            for tensor in _LAYER_TENSORS:
                for part in ("weight", "bias"):
                    value = f32(f"blk.{i}.{tensor}.{part}")
                    gemm = part == "weight" and not tensor.endswith("_norm")
                    weights[f"{tensor}.{part}"] = value.to(dtype) if gemm else value
            self.layers.append(_Layer(weights))


def _linear(x: torch.Tensor, w: dict[str, torch.Tensor], name: str, dtype) -> torch.Tensor:
    bias = w[f"{name}.bias"]
    return F.linear(x.to(dtype), w[f"{name}.weight"], bias.to(dtype))


def _norm(x: torch.Tensor, w: dict[str, torch.Tensor], name: str, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), w[f"{name}.weight"], w[f"{name}.bias"], eps)


def encode(model: BertWeights, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Hidden states (batch, length, n_embd) f32 of padded `ids` (mask: True on real tokens)."""
    batch, length = ids.shape
    x = model.token_embd[ids] + model.position_embd[:length]
    if model.token_type0 is not None:
        x = x + model.token_type0
    x = F.layer_norm(x, (x.shape[-1],), *model.embd_norm, model.eps)
    attend = mask[:, None, None, :]  # (batch, 1, 1, length): keys that are real tokens
    heads, dtype = model.num_heads, model.dtype
    for layer in model.layers:
        w = layer.weights

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, heads, -1).transpose(1, 2)

        q, k, v = (split(_linear(x, w, n, dtype)) for n in ("attn_q", "attn_k", "attn_v"))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
        attn = attn.transpose(1, 2).reshape(batch, length, -1)
        x = _norm(
            x + _linear(attn, w, "attn_output", dtype).float(), w, "attn_output_norm", model.eps
        )
        up = F.gelu(_linear(x, w, "ffn_up", dtype))
        x = _norm(x + _linear(up, w, "ffn_down", dtype).float(), w, "layer_output_norm", model.eps)
    return x


def pool(hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, how: str):
    if how == "mean":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / lengths.unsqueeze(-1).to(hidden.dtype)
    if how == "cls":
        return hidden[:, 0]
    if how == "last":
        return hidden[torch.arange(hidden.shape[0]), lengths - 1]
    raise ValueError(f"unknown pooling {how!r}")


def length_groups(lengths: list[int], waste: float = 1.5) -> list[list[int]]:
    """Indices grouped by length, shortest first, each group's padded size (members x its
    longest) at most `waste` x its real tokens: one long input does not pad 31 short ones."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]
        if groups and (len(groups[-1]) + 1) * n <= waste * (real + n):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups


class TorchEmbeddingExecutor:
    """EmbeddingExecutor's interface (ggml_embed.py) with the pass run by PyTorch; tokenizing,
    the model's facts and the pass budgets come from the llama.cpp executor it wraps."""

    def __init__(self, ggml: Any, dtype: torch.dtype = torch.bfloat16):
        self.ggml = ggml
        self.gguf_path = ggml.gguf_path
        self.dtype = dtype
        self.path_name = f"torch-{DTYPE_NAMES[dtype]}"
        self.weights = BertWeights(read_gguf_metadata(ggml.gguf_path), dtype)
        self.architecture, self.pooling = ggml.architecture, ggml.pooling
        self.vocab_size, self.n_embd = ggml.vocab_size, ggml.n_embd
        self.max_input_tokens, self.max_batch_tokens = ggml.max_input_tokens, ggml.max_batch_tokens
        self.max_seqs, self.n_threads = ggml.max_seqs, ggml.n_threads
        # the scheduler's pass size: no attention across inputs here (each length group is
        # padded apart), so a pass may take all it can hold; bigger groups run faster GEMMs
        self.pass_tokens = ggml.max_batch_tokens

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.ggml.tokenize(text, add_special)

    def sep_token(self) -> int:
        return self.ggml.sep_token()

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One pass: (len(inputs), n_embd) float32, each row L2-normalised. The inputs run in
        groups of similar length (padding wastes at most ~1/3 of a group's tokens)."""
        self.ggml.check_pass(inputs)
        out = np.empty((len(inputs), self.n_embd), dtype=np.float32)
        with torch.inference_mode():
            for group in length_groups([len(ids) for ids in inputs]):
                out[group] = self._embed_padded([inputs[i] for i in group])
        return out

    def _embed_padded(self, inputs: list[list[int]]) -> np.ndarray:
        lengths = torch.tensor([len(ids) for ids in inputs])
        ids = torch.zeros(len(inputs), int(lengths.max()), dtype=torch.long)
        for row, seq in enumerate(inputs):
            ids[row, : len(seq)] = torch.tensor(seq)
        mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        hidden = encode(self.weights, ids, mask)
        pooled = pool(hidden, mask, lengths, self.pooling)
        return F.normalize(pooled.float(), dim=-1).numpy()

    def close(self) -> None:
        self.ggml.close()
