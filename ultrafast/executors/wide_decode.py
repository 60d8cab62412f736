"""Wide decode steps in torch: one token per slot for many slots, over the KV mirror.

Why: a 16-wide decode costs llama.cpp's AVX-512 kernels ~100 ms on the 2-core AMX Xeon and a
bf16 oneDNN forward ~35-47 ms (`../shared/notes/amx-wide-pass-design.md`), while a 1-2 wide
step is cheaper on llama.cpp. So steps of many 1-token decodes run here (wide_exec.py routes
them, wide_decode_route.py measures from which width) and the rest stays on llama.cpp.

The weights are the wide prefill's (wide_forward.py: fused bf16 q/k/v and gate/up, float32
residual, norms, RoPE) plus the final norm and the bf16 lm_head. Each slot's KV lives in the
torch mirror (wide_kv_mirror.py); the two moves between it and llama.cpp's slot are here:
`pull` reads the rows llama.cpp computed since the mirror last saw the slot, `push` writes the
rows torch computed into llama.cpp's slot (through the per-sequence state API, ggml_kv_rows.py),
each moving only the delta. Attention: the step's slots (sorted) lie within a range of at most
1.5x their count in the common case, so K/V are views of that range (the gaps' rows masked
and dropped; a wider scatter gathers a copy); one SDPA per layer over the longest slot's
length with a per-row mask of each slot's own length, each KV head's query heads taking the
query-row axis (exact, and about 1.5x faster than SDPA's GQA expansion at 16 slots).
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np
import torch
import torch.nn.functional as F

from ultrafast.executors import decode_attention, ggml_kv_rows
from ultrafast.executors.decode_attention import Kernel
from ultrafast.executors.ggml_kv_rows import SlotRows
from ultrafast.executors.packed_linear import linear
from ultrafast.executors.wide_forward import BF16, WideForward
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


@torch.inference_mode()
def decode_logits(
    fw: WideForward, mirror: KVMirror, tokens: list[int], slots: list[int], positions: list[int]
) -> torch.Tensor:
    """float32 [B, vocab] logits of one decode step (`slots` sorted and distinct, each holding
    exactly [0, position) in the mirror); the step's K/V rows are written to the mirror."""
    assert fw.lm_head is not None and fw.norm is not None
    for slot, position in zip(slots, positions):
        mirror.reserve(slot, position + 1)
    pos = torch.tensor(positions, dtype=torch.long)
    slot_t = torch.tensor(slots, dtype=torch.long)
    kernel, _ = attention_choice(fw.heads, fw.kv_heads, fw.head_dim)
    if kernel is not None:
        return _kernel_step(fw, mirror, kernel, tokens, slots, positions, pos, slot_t)
    length = max(positions) + 1
    mask = torch.arange(length)[None, :] <= pos[:, None]
    span = slots[-1] - slots[0] + 1
    # the slots' K/V as views of the mirror when they lie within 1.5x their count: the gaps'
    # rows are attended too, masked to one position and dropped (16 slots over 22 rows at 1,100
    # positions: 20% faster than gathering the step's rows into a copy per layer; over 31
    # rows 30% slower, as SDPA still reads a masked row's keys)
    in_range = 2 * span <= 3 * len(slots)
    select = slice(slots[0], slots[-1] + 1) if in_range else slot_t
    gaps = in_range and span != len(slots)
    at = slot_t - slots[0]  # the step's rows within the range
    if gaps:
        ranged = torch.zeros(span, length, dtype=torch.bool)
        ranged[:, 0] = True  # an idle row sees one key: no empty softmax
        ranged[at] = mask
        mask = ranged
    mask = mask[:, None, None, :]
    x = fw.embed[torch.tensor(tokens, dtype=torch.long)].float()
    cos, sin = fw.cos[pos][:, None], fw.sin[pos][:, None]
    for i, layer in enumerate(fw.layers):
        qk, v = fw._qkv(x, layer, cos, sin)
        qk = qk.to(BF16)
        mirror.write_step(i, slot_t, pos, qk[:, fw.heads :], v)
        keys, values = mirror.step_view(i, select, length)
        # a KV head's query heads as the query rows: one SDPA with no GQA expansion
        grouped = qk[:, : fw.heads].view(len(slots), fw.kv_heads, -1, fw.head_dim)
        if gaps:
            grouped = grouped.new_zeros((span, *grouped.shape[1:])).index_copy_(0, at, grouped)
        a = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
        if gaps:
            a = a.index_select(0, at)
        x.add_(linear(a.reshape(len(slots), -1), layer.o))
        h = linear(fw._norm(x, layer.ffn_norm).to(BF16), layer.gate_up)
        gate, up = h.chunk(2, dim=-1)
        x.add_(linear(F.silu(gate) * up, layer.down))
    mirror.mark_step(slots, positions)
    return linear(fw._norm(x, fw.norm).to(BF16), fw.lm_head).float()


def _kernel_step(fw, mirror, kernel, tokens, slots, positions, pos, slot_t) -> torch.Tensor:
    """decode_logits with the C kernel's attention: each slot's mirror row read in place, no
    mask, no gather, whatever rows the slots hold."""
    assert fw.lm_head is not None and fw.norm is not None
    lens = pos + 1
    x = fw.embed[torch.tensor(tokens, dtype=torch.long)].float()
    cos, sin = fw.cos[pos][:, None], fw.sin[pos][:, None]
    for i, layer in enumerate(fw.layers):
        qk, v = fw._qkv(x, layer, cos, sin)
        mirror.write_step(i, slot_t, pos, qk[:, fw.heads :].to(BF16), v)
        a = decode_attention.attend(
            kernel, qk[:, : fw.heads], mirror.keys[i], mirror.values[i], slot_t, lens
        )
        x.add_(linear(a.to(BF16).view(len(slots), -1), layer.o))
        h = linear(fw._norm(x, layer.ffn_norm).to(BF16), layer.gate_up)
        gate, up = h.chunk(2, dim=-1)
        x.add_(linear(F.silu(gate) * up, layer.down))
    mirror.mark_step(slots, positions)
    return linear(fw._norm(x, fw.norm).to(BF16), fw.lm_head).float()


def pull(executor, slot: int, end: int) -> str | None:
    """Copy llama.cpp's rows [mirror length, end) of `slot` into the mirror; an error or None."""
    fw, mirror = executor.wide, executor.mirror
    start = mirror.length(slot)
    try:
        rows = ggml_kv_rows.parse_chunk(executor.ggml_export(slot, end))
    except ValueError as exc:
        return f"wide decode: the slot's KV cannot be read: {exc}"
    order = np.argsort(rows.positions, kind="stable")  # cells in position order
    if len(order) < end or not np.array_equal(rows.positions[order[:end]], np.arange(end)):
        return "wide decode: the slot's KV is not positions [0, end)"
    cells = order[start:end]
    keys = [fw.from_gguf_keys(k[cells]) for k in rows.k]
    values = [fw.from_gguf_values(v[cells]) for v in rows.v]
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
