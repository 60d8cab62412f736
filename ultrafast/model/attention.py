"""Attention over static per-slot KV: per layer one [num_slots, num_kv_heads, max_len, head_dim]
tensor for keys and one for values, allocated once.

Static shapes keep the path compile/CUDA-graph friendly. Each step writes the new tokens' k/v at
(slot, position) and attends each token over its own slot's positions [0, its position] (within
the layer's sliding window, if any). Whatever a slot held at or beyond a sequence's start
position (a former owner, rejected drafts) is overwritten or masked, never read: the contract's
"drop stale KV" costs nothing here.

Two shapes of work per step: sequences with few new tokens (decodes, decode + drafts) go through
one batched SDPA over their gathered slots with a length mask; longer prefill chunks get one
SDPA each. GQA is handled by folding each KV head's query heads into the query dimension, so
every SDPA call is plain multi-head attention (any backend, no K/V repeat).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

# sequences with at most this many new tokens share the batched, padded SDPA call; padding a
# query to this length costs less than one more kernel launch, a long prefill chunk does not
MAX_BATCHED_QUERY_TOKENS = 8


class SeqSpan(NamedTuple):
    """One sequence's share of the flattened batch (tokens are in plan order)."""

    slot_id: int
    start_position: int  # position of its first new token
    num_tokens: int


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layer_sliding_windows: Sequence[int | None] | None = None,
    ):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self.device = torch.device(device)
        self.layer_sliding_windows = tuple(layer_sliding_windows or (None,) * num_layers)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_prefix(self, src_slot_id: int, dst_slot_id: int, num_tokens: int) -> None:
        """Positions [0, num_tokens) of src into dst (a prefix-cache hit); dst beyond is stale."""
        if src_slot_id == dst_slot_id or num_tokens <= 0:
            return
        for cache in self.k + self.v:
            cache[dst_slot_id, :, :num_tokens] = cache[src_slot_id, :, :num_tokens]

    def begin_step(self, spans: Sequence[tuple[int, int, int]]) -> StepAttention:
        """The backend for one forward pass over spans (slot_id, start_position, num_tokens)."""
        return StepAttention(self, [SeqSpan(*s) for s in spans])


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask: q_pos [..., Q, 1] may see k_pos [K] -> [..., Q, K]."""
    mask = k_pos <= q_pos
    if window is not None:  # HF: a key is visible while q - k < window
        mask &= k_pos > q_pos - window
    return mask


def _fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, Q, D] -> [B, Hkv, G*Q, D]: query head h reads KV head h // G, as in HF."""
    b, hq, nq, d = q.shape
    return q.reshape(b, num_kv_heads, (hq // num_kv_heads) * nq, d)


class StepAttention:
    """`attn(layer_idx, q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D]) -> out[T, Hq, D]`."""

    def __init__(self, cache: SlotKVCache, spans: list[SeqSpan]):
        if not spans:
            raise ValueError("a step needs at least one sequence")
        self.cache = cache
        dev = cache.device
        slots: list[int] = []
        positions: list[int] = []
        for s in spans:
            if (
                s.num_tokens < 1
                or s.start_position < 0
                or (s.start_position + s.num_tokens > cache.max_len)
            ):
                raise ValueError(f"span {s} does not fit a slot of {cache.max_len} positions")
            slots += [s.slot_id] * s.num_tokens
            positions += range(s.start_position, s.start_position + s.num_tokens)
        self.num_tokens = len(slots)
        self.token_slots = torch.tensor(slots, dtype=torch.long, device=dev)
        self.token_positions = torch.tensor(positions, dtype=torch.long, device=dev)
        offsets, offset = [], 0
        for s in spans:
            offsets.append(offset)
            offset += s.num_tokens
        short = [i for i, s in enumerate(spans) if s.num_tokens <= MAX_BATCHED_QUERY_TOKENS]
        self.long = [
            (s, off) for s, off in zip(spans, offsets) if s.num_tokens > MAX_BATCHED_QUERY_TOKENS
        ]
        # token rows the batched call answers (None: no short seqs)
        self.short_rows: torch.Tensor | None = None
        if short:
            self._plan_batched([spans[i] for i in short], [offsets[i] for i in short])
        self._masks: dict[int | None, torch.Tensor] = {}
        self._long_masks: dict[tuple[int, int | None], torch.Tensor] = {}

    def _plan_batched(self, spans: list[SeqSpan], offsets: list[int]) -> None:
        """Pad every short seq's queries to Q rows; a pad row repeats the seq's last token."""
        dev = self.cache.device
        num_q = max(s.num_tokens for s in spans)
        rows, q_pos, valid = [], [], []
        for s, off in zip(spans, offsets):
            for j in range(num_q):
                jj = min(j, s.num_tokens - 1)
                rows.append(off + jj)
                q_pos.append(s.start_position + jj)
                valid.append(j < s.num_tokens)
        self.batch_slots = torch.tensor([s.slot_id for s in spans], dtype=torch.long, device=dev)
        self.batch_rows = torch.tensor(rows, dtype=torch.long, device=dev).view(len(spans), num_q)
        self.batch_q_pos = torch.tensor(q_pos, dtype=torch.long, device=dev).view(len(spans), num_q)
        self.batch_num_keys = max(s.start_position + s.num_tokens for s in spans)
        valid_t = torch.tensor(valid, dtype=torch.bool, device=dev)
        self.batch_valid = None if all(valid) else valid_t
        self.short_rows = self.batch_rows.flatten()[valid_t]

    def _batch_mask(self, window: int | None, groups: int) -> torch.Tensor:
        """[B, 1, G*Q, K] mask for the batched call, built once per step per window."""
        if window not in self._masks:
            k_pos = torch.arange(self.batch_num_keys, device=self.cache.device)
            mask = _allowed(self.batch_q_pos[:, :, None], k_pos, window)  # [B, Q, K]
            self._masks[window] = mask.repeat(1, groups, 1)[:, None]
        return self._masks[window]

    def _batched(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        num_kv_heads = k_cache.shape[1]
        b, num_q = self.batch_rows.shape
        _, hq, d = q.shape
        qb = q[self.batch_rows].permute(0, 2, 1, 3)  # [B, Hq, Q, D]
        keys = k_cache[self.batch_slots, :, : self.batch_num_keys]  # [B, Hkv, K, D]
        values = v_cache[self.batch_slots, :, : self.batch_num_keys]
        mask = self._batch_mask(self.cache.layer_sliding_windows[layer_idx], hq // num_kv_heads)
        out = F.scaled_dot_product_attention(
            _fold_gqa(qb, num_kv_heads), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask
        )
        out = out.reshape(b, hq, num_q, d).permute(0, 2, 1, 3)  # [B, Q, Hq, D]
        out = out.reshape(b * num_q, hq, d)
        return out if self.batch_valid is None else out[self.batch_valid]

    def _one(self, layer_idx: int, q: torch.Tensor, span: SeqSpan, offset: int) -> torch.Tensor:
        """A long chunk alone: its queries against its slot's keys [0, its last position]."""
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        end = span.start_position + span.num_tokens
        window = self.cache.layer_sliding_windows[layer_idx]
        qs = q[offset : offset + span.num_tokens].transpose(0, 1)[None]  # [1, Hq, n, D]
        keys = k_cache[span.slot_id, :, :end][None].to(q.dtype)
        values = v_cache[span.slot_id, :, :end][None].to(q.dtype)
        if span.start_position == 0 and window is None:  # a fresh prompt: the fused causal path
            out = F.scaled_dot_product_attention(
                qs, keys, values, is_causal=True, enable_gqa=keys.shape[1] != qs.shape[1]
            )
            return out[0].transpose(0, 1)
        key = (offset, window)
        if key not in self._long_masks:
            dev = self.cache.device
            q_pos = torch.arange(span.start_position, end, device=dev)[:, None]
            self._long_masks[key] = _allowed(q_pos, torch.arange(end, device=dev), window)
        groups = qs.shape[1] // keys.shape[1]
        mask = self._long_masks[key].repeat(groups, 1)
        out = F.scaled_dot_product_attention(
            _fold_gqa(qs, keys.shape[1]), keys, values, attn_mask=mask
        )
        return out.reshape(1, qs.shape[1], span.num_tokens, -1)[0].transpose(0, 1)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        # write first, so every token sees its own and its chunk-mates' keys
        k_cache[self.token_slots, :, self.token_positions] = k.to(k_cache.dtype)
        v_cache[self.token_slots, :, self.token_positions] = v.to(v_cache.dtype)
        if not self.long:
            return self._batched(layer_idx, q)
        if self.short_rows is None and len(self.long) == 1:
            return self._one(layer_idx, q, *self.long[0])
        out = torch.empty_like(q)
        if self.short_rows is not None:
            out[self.short_rows] = self._batched(layer_idx, q)
        for span, offset in self.long:
            out[offset : offset + span.num_tokens] = self._one(layer_idx, q, span, offset)
        return out
