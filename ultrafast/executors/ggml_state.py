"""One llama.cpp sequence's KV state as a payload that fits any slot of any slot count.

llama.cpp's per-sequence state (`llama_state_seq_get_data`) is, in the pinned build,
    u32 magic | i32 source seq id | u32 n_stream | per stream: u32 cell_count [+ cells + data]
with one stream per slot (kv_unified=False) and only the sequence's own stream non-empty. The
payload keeps that one stream's chunk; an import rebuilds the header for the importer's slot
count with the chunk at the destination's stream. This relies on an internal layout: the
magic is checked both ways and tests/model/test_kv_export.py covers the re-wrap.
"""

from __future__ import annotations

import ctypes
import struct

import llama_cpp

STATE_MAGIC = 0xAF143CD8
_HEADER = struct.Struct("<IiI")
_COUNT = struct.Struct("<I")


def export_slot(ctx, slot_id: int, num_slots: int) -> bytes:
    size = llama_cpp.llama_state_seq_get_size(ctx, slot_id)
    buf = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, slot_id)
    state = bytes(memoryview(buf)[:written])
    magic, _seq, n_stream = _HEADER.unpack_from(state)
    if magic != STATE_MAGIC or n_stream != num_slots:
        raise RuntimeError(f"unexpected llama.cpp sequence state (magic {magic:#x})")
    start, end = _HEADER.size, len(state) - _COUNT.size * (num_slots - 1 - slot_id)
    before = state[start : start + _COUNT.size * slot_id]
    after = state[end:]
    if before.strip(b"\0") or after.strip(b"\0"):
        raise RuntimeError("sequence state spans more than its own stream")
    return state[start + len(before) : end]


def import_slot(ctx, slot_id: int, num_slots: int, chunk: bytes) -> None:
    """Raise ValueError when llama.cpp refuses the chunk (another model, KV type, layout)."""
    if len(chunk) < _COUNT.size or _COUNT.unpack_from(chunk)[0] == 0:
        raise ValueError("KV payload holds no cells")
    zero = b"\0" * _COUNT.size
    state = b"".join(
        (
            _HEADER.pack(STATE_MAGIC, slot_id, num_slots),
            zero * slot_id,
            chunk,
            zero * (num_slots - 1 - slot_id),
        )
    )
    buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    read = llama_cpp.llama_state_seq_set_data(ctx, buf, len(state), slot_id)
    if read != len(state):
        raise ValueError("llama.cpp refused the KV payload")
