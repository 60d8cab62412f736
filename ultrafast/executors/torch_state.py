"""One slot of the torch executor's static KV as a payload (a slice copy of every layer).

u32 layers | u32 kv heads | u32 positions | u32 head dim | u8 dtype name length | name |
K of every layer [heads, positions, head_dim] | V of every layer (same)
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import torch

from ultrafast.kvcache.fingerprint import file_sha256
from ultrafast.model.attention import SlotKVCache

_SHAPE = struct.Struct("<IIIIB")


def weights_identity(model_source: object) -> str:
    """A content hash of the weights' files; an in-memory model only matches itself."""
    if isinstance(model_source, (str, Path)):
        path = Path(model_source)
        if path.is_file():
            return file_sha256(path)
        files = sorted(p for p in path.glob("*") if p.suffix in (".safetensors", ".gguf", ".bin"))
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + file_sha256(f).encode())
        return digest.hexdigest()
    return f"in-memory-{id(model_source)}"


def export_slot(kv: SlotKVCache, slot_id: int, num_tokens: int) -> bytes:
    if not 0 < num_tokens <= kv.max_len:
        raise ValueError(f"cannot export {num_tokens} positions of a {kv.max_len}-slot")
    k = torch.stack([layer[slot_id, :, :num_tokens] for layer in kv.k])
    v = torch.stack([layer[slot_id, :, :num_tokens] for layer in kv.v])
    name = str(k.dtype).removeprefix("torch.").encode()
    header = _SHAPE.pack(k.shape[0], k.shape[1], num_tokens, k.shape[3], len(name)) + name
    data = torch.cat([k.flatten(), v.flatten()]).cpu().contiguous()
    return header + data.view(torch.uint8).numpy().tobytes()


def import_slot(kv: SlotKVCache, slot_id: int, payload: bytes, num_tokens: int) -> None:
    """Raise ValueError for a payload of another shape, dtype or length."""
    if len(payload) < _SHAPE.size:
        raise ValueError("KV payload is truncated")
    layers, heads, positions, head_dim, name_len = _SHAPE.unpack_from(payload)
    name = payload[_SHAPE.size : _SHAPE.size + name_len].decode(errors="replace")
    sample = kv.k[0]
    want = (len(kv.k), sample.shape[1], sample.shape[3], str(sample.dtype).removeprefix("torch."))
    if (layers, heads, head_dim, name) != want:
        raise ValueError(f"KV payload shape {(layers, heads, head_dim, name)} != slot {want}")
    if not num_tokens <= positions <= kv.max_len:
        raise ValueError(f"KV payload holds {positions} positions, {num_tokens} were expected")
    data = payload[_SHAPE.size + name_len :]
    per_side = layers * heads * positions * head_dim * sample.element_size()
    if len(data) != 2 * per_side:
        raise ValueError("KV payload is truncated")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(sample.dtype)
    k, v = raw.view(2, layers, heads, positions, head_dim).to(sample.device)
    for i in range(layers):
        kv.k[i][slot_id, :, :num_tokens] = k[i, :, :num_tokens]
        kv.v[i][slot_id, :, :num_tokens] = v[i, :, :num_tokens]
