"""One llama.cpp slot's KV chunk (ggml_state.py's payload) as per-layer row arrays and back.

The chunk of one KV stream in the pinned llama.cpp build is
    u32 cell_count | cell_count x (i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id)
    | u32 v_trans | u32 n_layer
    | per layer: i32 k_type, u64 k_row_bytes, cell_count rows
    | v_trans 0: per layer: i32 v_type, u64 v_row_bytes, cell_count rows
      v_trans 1: per layer: i32 v_type, u32 v_elem_bytes, u32 n_embd_v, n_embd_v x cell_count
This lets KV computed elsewhere (the wide pass, executors/wide_forward.py) enter a slot through
`llama_state_seq_set_data`, which validates types and row sizes itself. Only float KV types
(f32, f16) are read and written: a quantized cache (q8_0) has no rows to compute outside.
Every size is checked against the chunk's length: a layout change fails loudly, never silently.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

GGML_TYPES: dict[int, np.dtype] = {
    0: np.dtype(np.float32),
    1: np.dtype(np.float16),
}  # ggml_type id -> dtype
_U32 = struct.Struct("<I")
_TYPE_ROW = struct.Struct("<iQ")
_TYPE_TRANS = struct.Struct("<iII")


class KVLayoutError(ValueError):
    """The chunk is not the layout this module reads (another llama.cpp build, a q8_0 cache)."""


@dataclass
class SlotRows:
    """positions [cells]; k/v: per layer [cells, n_embd] in the cache's float dtype."""

    positions: np.ndarray
    k: list[np.ndarray]
    v: list[np.ndarray]
    v_trans: bool

    @property
    def num_cells(self) -> int:
        return len(self.positions)


def _dtype(type_id: int) -> np.dtype:
    if type_id not in GGML_TYPES:
        raise KVLayoutError(f"KV cache type {type_id} is not a float type (f32/f16)")
    return GGML_TYPES[type_id]


def _rows(buf: memoryview, at: int, cells: int, row_bytes: int, dtype: np.dtype):
    end = at + cells * row_bytes
    if row_bytes % dtype.itemsize or end > len(buf):
        raise KVLayoutError("KV chunk is shorter than its rows")
    data = np.frombuffer(buf[at:end], dtype=dtype).reshape(cells, row_bytes // dtype.itemsize)
    return data, end


def _meta(buf: memoryview, cells: int) -> tuple[np.ndarray, int]:
    """Cell positions; every cell must belong to exactly one sequence (a slot's own)."""
    if len(buf) < 4 + cells * 12:
        raise KVLayoutError("KV chunk is shorter than its cells")
    meta = np.frombuffer(buf[4 : 4 + cells * 12], dtype="<i4").reshape(cells, 3)
    if cells and (meta[:, 1] != 1).any():
        raise KVLayoutError("KV chunk has cells shared by several sequences")
    return meta[:, 0].copy(), 4 + cells * 12


def parse_chunk(chunk: bytes) -> SlotRows:
    """The rows of a chunk `ggml_state.export_slot` returned (views into `chunk`)."""
    buf = memoryview(chunk)
    (cells,) = _U32.unpack_from(buf)
    positions, at = _meta(buf, cells)
    v_trans, n_layer = struct.unpack_from("<II", buf, at)
    at += 8
    k: list[np.ndarray] = []
    v: list[np.ndarray] = []
    for _ in range(n_layer):
        type_id, row_bytes = _TYPE_ROW.unpack_from(buf, at)
        rows, at = _rows(buf, at + _TYPE_ROW.size, cells, row_bytes, _dtype(type_id))
        k.append(rows)
    for _ in range(n_layer):
        if v_trans:
            type_id, elem, n_embd = _TYPE_TRANS.unpack_from(buf, at)
            dtype = _dtype(type_id)
            if elem != dtype.itemsize:
                raise KVLayoutError("KV chunk's value element size does not match its type")
            cols, at = _rows(buf, at + _TYPE_TRANS.size, n_embd, cells * elem, dtype)
            v.append(cols.T)
        else:
            type_id, row_bytes = _TYPE_ROW.unpack_from(buf, at)
            rows, at = _rows(buf, at + _TYPE_ROW.size, cells, row_bytes, _dtype(type_id))
            v.append(rows)
    if at != len(buf):
        raise KVLayoutError(f"KV chunk has {len(buf) - at} bytes after its last layer")
    return SlotRows(positions, k, v, bool(v_trans))


def build_chunk(rows: SlotRows, seq_id: int = 0) -> bytes:
    """A chunk `ggml_state.import_slot` takes; rows' arrays already in the cache's dtype."""
    cells = rows.num_cells
    meta = np.empty((cells, 3), dtype="<i4")
    meta[:, 0] = rows.positions
    meta[:, 1] = 1
    meta[:, 2] = seq_id  # llama.cpp reads it and puts the cells in the importing sequence
    parts = [_U32.pack(cells), meta.tobytes(), struct.pack("<II", int(rows.v_trans), len(rows.k))]
    type_of = {dtype: type_id for type_id, dtype in GGML_TYPES.items()}
    for k in rows.k:
        parts += [_TYPE_ROW.pack(type_of[k.dtype], k.shape[1] * k.itemsize), _bytes(k)]
    for v in rows.v:
        if rows.v_trans:
            parts += [_TYPE_TRANS.pack(type_of[v.dtype], v.itemsize, v.shape[1]), _bytes(v.T)]
        else:
            parts += [_TYPE_ROW.pack(type_of[v.dtype], v.shape[1] * v.itemsize), _bytes(v)]
    return b"".join(parts)


def _bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def concat(prior: SlotRows, new: SlotRows) -> SlotRows:
    """prior's cells followed by new's (same layout)."""
    return SlotRows(
        np.concatenate([prior.positions, new.positions]),
        [np.concatenate([a, b]) for a, b in zip(prior.k, new.k)],
        [np.concatenate([a, b]) for a, b in zip(prior.v, new.v)],
        prior.v_trans,
    )


def prefix(rows: SlotRows, n: int) -> SlotRows:
    """rows' cells at positions [0, n), in position order; KVLayoutError where they are not
    exactly those positions."""
    keep = np.flatnonzero(rows.positions < n)
    keep = keep[np.argsort(rows.positions[keep], kind="stable")]
    if not np.array_equal(rows.positions[keep], np.arange(n)):
        raise KVLayoutError(f"the slot's KV does not hold positions [0, {n}) once each")
    return SlotRows(
        rows.positions[keep], [k[keep] for k in rows.k], [v[keep] for v in rows.v], rows.v_trans
    )
