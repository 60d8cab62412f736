"""Torch passes over the KV mirror: a step's prefill chunks and 1-token decodes as one forward.

Why: a 16-wide decode costs llama.cpp's AVX-512 kernels ~100 ms on the 2-core AMX Xeon and a
bf16 oneDNN forward ~35-47 ms (`../shared/notes/amx-wide-pass-design.md`), while a 1-2 wide
step is cheaper on llama.cpp; and a prefill pass and a decode pass in one step read the
weights twice where one forward reads them once. So `step_logits` runs a step's chunks
(`PrefillRows`: every token, attended over the slot's mirror rows in place) and its decodes
(`DecodeRows`) together (wide_exec.py routes them, wide_decode_route.py measures from which
width decodes alone come here) and the rest stays on llama.cpp.

The weights are the wide prefill's (wide_forward.py: fused bf16 q/k/v and gate/up, float32
residual, norms, RoPE) plus the final norm and the bf16 lm_head. Each slot's KV lives in the
torch mirror (wide_kv_mirror.py); the two moves between it and llama.cpp's slot are here:
`pull` reads the rows llama.cpp computed since the mirror last saw the slot, `push` writes the
rows torch computed into llama.cpp's slot (through the per-sequence state API, ggml_kv_rows.py),
each moving only the delta. Decode attention: the C kernel of decode_attention.py where it is
built and faster here, else one SDPA per layer over the step's slots (views of their range
where the sorted slots lie within 1.5x their count, gaps masked and dropped; a wider scatter
gathers a copy) with a per-row length mask, each KV head's query heads on the query-row axis.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ultrafast.executors import decode_attention, fused_ops, ggml_kv_rows
from ultrafast.executors.decode_attention import Kernel
from ultrafast.executors.ggml_kv_rows import SlotRows
from ultrafast.executors.packed_linear import linear
from ultrafast.executors.prefill_attention import causal_mask
from ultrafast.executors.wide_forward import BF16, WideForward, padded_rows
from ultrafast.executors.wide_kv_mirror import KVMirror

log = logging.getLogger(__name__)


def new_mirror(fw: WideForward, max_len: int, max_rows: int | None = None) -> KVMirror:
    return KVMirror(fw.num_layers, fw.kv_heads, fw.head_dim, max_len, max_rows)


@functools.cache
def attention_choice(heads: int, kv_heads: int, head_dim: int) -> tuple[Kernel | None, str]:
    """The decode attention this model's steps use (decode_attention.py), chosen once per
    shape by timing the C kernel against this module's SDPA path; and its status clause."""
    kernel, status = decode_attention.choose(heads, kv_heads, head_dim, _time_sdpa)
    log.info("wide decode: %s", status)
    return kernel, status


def _time_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lens) -> float:
    """Seconds of the SDPA path's attention (below) on the kernel timing's shape."""
    batch, heads, dim = q.shape
    length = keys.shape[2]
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
    started = time.perf_counter()
    grouped = q.to(BF16).view(batch, keys.shape[1], -1, dim)
    F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
    return time.perf_counter() - started


class DecodeRows:
    """The 1-token decode rows of a torch pass (`slots` sorted and distinct, each holding
    exactly [0, position) in the mirror): each layer writes their K/V row to the mirror and
    attends over the slot's rows, by the C kernel where chosen (decode_attention.py), else by
    SDPA over views of the slots' range (gaps masked, a wide scatter gathered)."""

    def __init__(self, fw: WideForward, mirror: KVMirror, slots: list[int], positions: list[int]):
        self.fw, self.mirror, self.slots, self.positions = fw, mirror, slots, positions
        self.pos = torch.tensor(positions, dtype=torch.long)
        self.slot_t = torch.tensor(slots, dtype=torch.long)
        self.kernel, _ = attention_choice(fw.heads, fw.kv_heads, fw.head_dim)
        if self.kernel is not None:
            self.rows = decode_attention.rows_of(slots, [p + 1 for p in positions])
        else:
            self._sdpa_setup()

    def _sdpa_setup(self) -> None:
        slots, pos = self.slots, self.pos
        self.length = length = max(self.positions) + 1
        mask = torch.arange(length)[None, :] <= pos[:, None]
        span = slots[-1] - slots[0] + 1
        # the slots' K/V as views of the mirror when they lie within 1.5x their count: the
        # gaps' rows are attended too, masked to one position and dropped (16 slots over 22
        # rows at 1,100 positions: 20% faster than gathering the step's rows into a copy per
        # layer; over 31 rows 30% slower, as SDPA still reads a masked row's keys)
        in_range = 2 * span <= 3 * len(slots)
        self.select = slice(slots[0], slots[-1] + 1) if in_range else self.slot_t
        self.gaps = in_range and span != len(slots)
        self.at = self.slot_t - slots[0]  # the step's rows within the range
        self.span = span
        if self.gaps:
            ranged = torch.zeros(span, length, dtype=torch.bool)
            ranged[:, 0] = True  # an idle row sees one key: no empty softmax
            ranged[self.at] = mask
            mask = ranged
        self.mask = mask[:, None, None, :]

    def attend(self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[D, heads * d] bf16 from the rows' projection h (q|k|v heads in the GEMMs' dtype)
        and RoPE rows; the mirror holds bf16."""
        fw, mirror, n = self.fw, self.mirror, len(self.slots)
        qk, v = fw.rope_qk(h, fw.layers[layer], cos, sin)
        mirror.write_step(layer, self.slot_t, self.pos, qk[:, fw.heads :].to(BF16), v.to(BF16))
        if self.kernel is not None:
            keys, values = mirror.keys[layer], mirror.values[layer]
            a = decode_attention.attend(self.kernel, qk[:, : fw.heads], keys, values, self.rows)
            return a.to(BF16).view(n, -1)
        keys, values = mirror.step_view(layer, self.select, self.length)
        # a KV head's query heads as the query rows: one SDPA with no GQA expansion
        grouped = qk[:, : fw.heads].to(BF16).view(n, fw.kv_heads, -1, fw.head_dim)
        if self.gaps:
            grouped = grouped.new_zeros((self.span, *grouped.shape[1:])).index_copy_(
                0, self.at, grouped
            )
        a = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=self.mask)
        if self.gaps:
            a = a.index_select(0, self.at)
        return a.reshape(n, -1)

    def done(self) -> None:
        self.mirror.mark_step(self.slots, self.positions)


class PrefillRows:
    """The prefill chunks of a torch pass, every token of each (`chunks[j]` of slot `slots[j]`,
    its rows [start, start + n) of the flat batch; the slot holds [0, position) in the mirror):
    each layer writes the chunks' K/V to the mirror, then attends each chunk over the mirror's
    [0, end) of its slot in place (no copy of the earlier rows), with the causal mask built
    once per pass, not per layer (wide_forward's fused SDPA)."""

    def __init__(self, fw: WideForward, mirror: KVMirror, slots: list[int], chunks: list):
        self.fw, self.mirror, self.slots, self.chunks = fw, mirror, slots, chunks
        self.end = max(c.start + c.num_tokens for c in chunks)  # the chunks' rows: [0, end)
        self.masks = [  # SDPA's masks; the AMX kernel needs none
            causal_mask(c.num_tokens, c.end) if c.position and fw.prefill_kernel is None else None
            for c in chunks
        ]

    def attend(self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[T, heads * d] bf16 from the rows' projection h (bf16 q|k|v heads) and RoPE rows.
        Where the fused ops store it (fused_ops.rope_store), RoPE writes the bf16 queries and
        the chunk's K/V rows into the mirror in one pass: a float q|k, its bf16 cast and two
        transposing copies were ~6 ms of a 512-token step's ~130 (2-core AMX Xeon)."""
        fw, heads, store = self.fw, self.fw.heads, self.fw.stores_rope(self.fw.layers[layer])
        if not store:
            qk, v = fw.rope_qk(h, fw.layers[layer], cos, sin)
            qk = qk.to(BF16)
        out = torch.empty(h.shape[0], heads * fw.head_dim, dtype=BF16)  # each chunk's rows
        out[self.end :] = 0  # the padding rows
        for slot, c, mask in zip(self.slots, self.chunks, self.masks):
            rows = slice(c.start, c.start + c.num_tokens)
            keys = self.mirror.keys[layer][slot, :, : c.end]
            values = self.mirror.values[layer][slot, :, : c.end]
            if store:
                assert fw.fused is not None
                q = fused_ops.rope_store(
                    fw.fused, h[rows], heads, fw.head_dim, cos[rows], sin[rows],
                    keys[:, c.position :], values[:, c.position :],
                )  # fmt: skip
            else:
                keys[:, c.position :] = qk[rows, heads:].transpose(0, 1)
                values[:, c.position :] = v[rows].transpose(0, 1)
                q = qk[rows, :heads]
            fw._causal_attention(q, keys, values, mask, out[rows])
        return out

    def done(self) -> None:
        for slot, c in zip(self.slots, self.chunks):
            self.mirror.lens[slot] = c.end


@torch.inference_mode()
def step_logits(
    fw: WideForward,
    mirror: KVMirror,
    prefill: tuple[list[int], list[int], list, list[int]] | None,
    decodes: tuple[list[int], list[int], list[int]] | None,
    logits_of: Sequence[int] = (),
) -> torch.Tensor:
    """One torch pass over a step's prefill chunks and 1-token decodes together (one read of
    the weights where two passes read them twice): `prefill` = (token ids, positions, chunks,
    slots), `decodes` = (tokens, slots sorted, positions). Every row's K/V goes to the
    mirror. Returns float32 logits of the last rows of the chunks numbered in `logits_of`,
    then of every decode, in that order."""
    assert fw.lm_head is not None and fw.norm is not None
    ids, positions = ([], []) if prefill is None else (list(prefill[0]), list(prefill[1]))
    # the pass's whole row count (chunks, padding, decodes) is padded_rows': oneDNN builds a
    # primitive per row count, ~10-20 ms at a new one (30-layer MLP at 1,031 rows: 113 ms
    # the first time, 99 after, AMX Xeon), and chunks + k decodes made a new count of most
    # served steps while streams joined (MLP 114-134 ms where 1,024 rows took 103)
    decoding = 0 if decodes is None else len(decodes[0])
    rows = padded_rows(len(ids) + decoding) - decoding if ids else 0
    ids += [0] * (rows - len(ids))  # padding rows: attended by no one, dropped
    positions += [0] * (rows - len(positions))
    for slot, end in _room(prefill, decodes):
        mirror.reserve(slot, end)
    parts: list = []
    if prefill is not None:
        parts.append(PrefillRows(fw, mirror, prefill[3], prefill[2]))
    if decodes is not None:
        parts.append(DecodeRows(fw, mirror, decodes[1], decodes[2]))
        ids, positions = ids + decodes[0], positions + decodes[2]
    pos = torch.tensor(positions, dtype=torch.long)
    x = fw.embed[torch.tensor(ids, dtype=torch.long)].float()
    cos, sin = fw.cos[pos], fw.sin[pos]
    splits = [rows, len(ids) - rows] if len(parts) == 2 else [len(ids)]

    def attend(i: int, h: torch.Tensor) -> torch.Tensor:
        attended = [
            part.attend(i, *rows)
            for part, rows in zip(parts, zip(h.split(splits), cos.split(splits), sin.split(splits)))
        ]
        return attended[0] if len(attended) == 1 else torch.cat(attended)

    fw.run_layers(x, attend)
    for part in parts:
        part.done()
    chunks = [] if prefill is None else prefill[2]
    wanted = [chunks[j].start + chunks[j].num_tokens - 1 for j in logits_of]
    wanted += range(rows, len(ids))
    return linear(fw.norm_for_gemm(x[wanted], fw.norm), fw.lm_head).float()


def _room(prefill, decodes) -> list[tuple[int, int]]:
    """(slot, end) of every row the pass writes: reserved before any view of the mirror."""
    room = [] if prefill is None else [(s, c.end) for s, c in zip(prefill[3], prefill[2])]
    if decodes is not None:
        room += [(s, p + 1) for s, p in zip(decodes[1], decodes[2])]
    return room


def decode_logits(
    fw: WideForward, mirror: KVMirror, tokens: list[int], slots: list[int], positions: list[int]
) -> torch.Tensor:
    """float32 [B, vocab] logits of one decode step (`slots` sorted and distinct, each holding
    exactly [0, position) in the mirror); the step's K/V rows are written to the mirror."""
    return step_logits(fw, mirror, None, (tokens, slots, positions))


def pull(executor, slot: int, end: int) -> str | None:
    """Copy llama.cpp's rows [mirror length, end) of `slot` into the mirror; an error or None."""
    fw, mirror = executor.wide, executor.mirror
    start = mirror.length(slot)
    try:  # cells [0, end) in position order, or KVLayoutError (a ValueError)
        rows = ggml_kv_rows.prefix(ggml_kv_rows.parse_chunk(executor.ggml_export(slot, end)), end)
    except ValueError as exc:
        return f"wide decode: the slot's KV cannot be read: {exc}"
    keys = [fw.from_gguf_keys(k[start:end]) for k in rows.k]
    values = [fw.from_gguf_values(v[start:end]) for v in rows.v]
    mirror.put_rows(slot, start, keys, values)
    return None


def push(executor, slot: int, held: int, end: int) -> None:
    """Write the mirror's rows [held, end) of `slot` into llama.cpp's slot, which holds
    [0, held); raise ValueError where llama.cpp refuses them (the slot is then empty)."""
    fw, mirror = executor.wide, executor.mirror
    dtype = ggml_kv_rows.GGML_TYPES[0 if executor.kv_cache_dtype == "f32" else 1]
    keys, values = mirror.rows(slot, held, end)
    new = SlotRows(
        np.arange(held, end, dtype=np.int32),
        [_gguf_rows(fw._to_gguf_keys(k.transpose(0, 1)), dtype) for k in keys],
        [_gguf_rows(v.transpose(0, 1).reshape(end - held, -1), dtype) for v in values],
        v_trans=not executor.flash_attn,
    )
    if held:
        new = ggml_kv_rows.concat(ggml_kv_rows.parse_chunk(executor.ggml_export(slot, held)), new)
    executor.ggml_import(slot, ggml_kv_rows.build_chunk(new), end)


def _gguf_rows(rows: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    return rows.float().numpy().astype(dtype)
