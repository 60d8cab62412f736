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
    # llama.cpp writes straight into a bytearray (lazily zeroed, unlike a ctypes array) and
    # the slot's chunk is copied out once: the copies cost more than the state read itself
    size = llama_cpp.llama_state_seq_get_size(ctx, slot_id)
    state = bytearray(size)
    view = (ctypes.c_uint8 * size).from_buffer(state)
    written = llama_cpp.llama_state_seq_get_data(ctx, view, size, slot_id)
    del view  # a live ctypes view would pin the bytearray
    with memoryview(state) as mv:
        magic, _seq, n_stream = _HEADER.unpack_from(mv)
        if magic != STATE_MAGIC or n_stream != num_slots:
            raise RuntimeError(f"unexpected llama.cpp sequence state (magic {magic:#x})")
        start, end = _HEADER.size, written - _COUNT.size * (num_slots - 1 - slot_id)
        chunk_start = start + _COUNT.size * slot_id
        if any(mv[start:chunk_start]) or any(mv[end:written]):
            raise RuntimeError("sequence state spans more than its own stream")
        return bytes(mv[chunk_start:end])


def import_slot(ctx, slot_id: int, num_slots: int, chunk: bytes) -> None:
    """Raise ValueError when llama.cpp refuses the chunk (another model, KV type, layout)."""
    if len(chunk) < _COUNT.size or _COUNT.unpack_from(chunk)[0] == 0:
        raise ValueError("KV payload holds no cells")
    zero = b"\0" * _COUNT.size
    state = bytearray(_HEADER.pack(STATE_MAGIC, slot_id, num_slots))
    state += zero * slot_id
    state += chunk
    state += zero * (num_slots - 1 - slot_id)
    size = len(state)
    view = (ctypes.c_uint8 * size).from_buffer(state)  # no second copy of the payload
    read = llama_cpp.llama_state_seq_set_data(ctx, view, size, slot_id)
    del view
    if read != size:
        raise ValueError("llama.cpp refused the KV payload")
