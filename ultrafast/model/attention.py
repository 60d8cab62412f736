"""Attention over static per-slot KV: one [slots, kv_heads, max_len, head_dim] tensor per layer.

Static shapes keep the path compile/CUDA-graph friendly. Each step writes the new tokens' k/v at
(slot, position) and attends each token over its own slot's positions [0, its position], so
whatever a slot held beyond a sequence's start position (a former owner, rejected drafts) is
never read: the contract's "drop stale KV" costs nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SeqSpan:
    slot_id: int
    start_position: int
    num_tokens: int


class SlotKVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.device = torch.device(device)

    def copy_prefix(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        self.k[:, dst_slot, :, :num_tokens] = self.k[:, src_slot, :, :num_tokens]
        self.v[:, dst_slot, :, :num_tokens] = self.v[:, src_slot, :, :num_tokens]

    def step(self, spans: list[SeqSpan]) -> "StepAttention":
        return StepAttention(self, spans)


class StepAttention:
    """The backend for one forward pass: `attn(layer, q, k, v)` with q [T, Hq, D]."""

    def __init__(self, cache: SlotKVCache, spans: list[SeqSpan]):
        self.cache = cache
        self.spans = spans
        dev = cache.device
        slots, positions = [], []
        for s in spans:
            slots += [s.slot_id] * s.num_tokens
            positions += range(s.start_position, s.start_position + s.num_tokens)
        self.token_slots = torch.tensor(slots, dtype=torch.long, device=dev)
        self.token_positions = torch.tensor(positions, dtype=torch.long, device=dev)
        self.all_decode = all(s.num_tokens == 1 for s in spans)
        if self.all_decode:  # one batched SDPA with a key-length mask
            lengths = torch.tensor([s.start_position + 1 for s in spans], device=dev)
            self.max_kv = int(lengths.max())
            self.mask = (torch.arange(self.max_kv, device=dev)[None, :] < lengths[:, None])[
                :, None, None, :]
        else:  # per-sequence causal masks with the offset of its cached prefix
            self.masks = []
            for s in spans:
                end = s.start_position + s.num_tokens
                q_pos = torch.arange(s.start_position, end, device=dev)
                self.masks.append(torch.arange(end, device=dev)[None, :] <= q_pos[:, None])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        k_cache[self.token_slots, :, self.token_positions] = k.to(k_cache.dtype)
        v_cache[self.token_slots, :, self.token_positions] = v.to(v_cache.dtype)
        if self.all_decode:
            slots = self.token_slots
            keys = k_cache[slots, :, :self.max_kv].to(q.dtype)
            values = v_cache[slots, :, :self.max_kv].to(q.dtype)
            out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values,
                                                 attn_mask=self.mask, enable_gqa=True)
            return out[:, :, 0, :]
        outs, offset = [], 0
        for span, mask in zip(self.spans, self.masks):
            end = span.start_position + span.num_tokens
            qs = q[offset:offset + span.num_tokens].transpose(0, 1)[None]
            keys = k_cache[span.slot_id, :, :end].to(q.dtype)[None]
            values = v_cache[span.slot_id, :, :end].to(q.dtype)[None]
            out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask,
                                                 enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
            offset += span.num_tokens
        return torch.cat(outs, dim=0)
