"""The torch side's copy of llama.cpp's slots for wide decode steps (executors/wide_decode.py).

Per layer one K and one V tensor `[rows, kv_heads, capacity, head_dim]` bf16 (HF layout: RoPE
halves, not llama.cpp's interleaved pairs), indexed by slot id. The tensors live in anonymous
private mappings: a page costs memory only once written (reads of the rest see the kernel's
zero page), and a replaced tensor's mapping goes back to the system at once. So the rows
cover every slot from the first use (`max_rows`, the slot count: a row costs nothing until its
slot writes), and so does the capacity: `FIRST_CAPACITY` positions (2,048, at most `max_len`)
from the first use, a position costing nothing until written; past it the capacity grows by
need, by half at least, in steps of 64 (never past `max_len`): a growth copies each slot's
written positions only. Why not grow from the first positions: each growth copies every
slot's rows (32 slots after a level of short prompts: ~170 MB, 20-45 ms), and the first
1,000-token prompts after short ones paid three, ~45 ms in each of their first steps.
The mirror's memory is about the positions the slots hold, not rows x capacity (16 streams of
1,128 tokens: 0.4 GiB resident where the zero-filled tensors held 0.7-1.1 GiB, plus the freed
copies of every growth that malloc kept).
`lens[slot]` says that positions [0, lens[slot]) hold that slot's KV; which side is ahead of
the other is the executor's business (wide_exec.py), this class only stores.
"""

from __future__ import annotations

import mmap

import torch

BF16 = torch.bfloat16
_STEP = 64  # capacity grows in multiples of this many positions, by half at least
FIRST_CAPACITY = 2048  # positions from the first use (at most max_len): paged in as written


class KVMirror:
    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, max_len: int, max_rows=None
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.max_len, self.max_rows = max_len, max_rows
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lens: dict[int, int] = {}
        self._rows = self._capacity = 0
        self._resize(0, 0)

    def length(self, slot: int) -> int:
        return self.lens.get(slot, 0)

    def trim(self, slot: int, end: int) -> None:
        """Forget the slot's positions >= end."""
        if self.lens.get(slot, 0) > end:
            self.lens[slot] = end

    def reserve(self, slot: int, end: int) -> None:
        """Room for `slot`'s positions [0, end)."""
        rows, capacity = self._rows, self._capacity
        if rows <= slot:
            rows = max(slot + 1, rows + rows // 2)
            rows = rows if self.max_rows is None else max(slot + 1, self.max_rows)
        if capacity < end:
            wanted = max(end, capacity + capacity // 2, FIRST_CAPACITY)
            capacity = min(self.max_len, -(-wanted // _STEP) * _STEP)
        if (rows, capacity) != (self._rows, self._capacity):
            self._resize(rows, capacity)

    @torch.inference_mode()  # the decode step writes them in inference mode
    def _resize(self, rows: int, capacity: int) -> None:
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        for tensors in (self.keys, self.values):
            grown = _lazy_zeros((self.num_layers, *shape)).unbind(0)
            for slot, n in self.lens.items():  # written positions only: the rest stays unpaged
                n = min(n, self._capacity)
                if n:
                    for new, old in zip(grown, tensors):
                        new[slot, :, :n] = old[slot, :, :n]
            tensors[:] = grown
        self._rows, self._capacity = rows, capacity

    @torch.inference_mode()  # the decode step writes them in inference mode
    def put_rows(self, slot: int, start: int, keys, values) -> None:
        """Write per layer [kv_heads, n, head_dim] rows at positions [start, start + n); the
        slot then holds [0, start + n) (its earlier positions must already be there)."""
        n = keys[0].shape[1]
        self.reserve(slot, start + n)
        for i in range(self.num_layers):
            self.keys[i][slot, :, start : start + n] = keys[i]
            self.values[i][slot, :, start : start + n] = values[i]
        self.lens[slot] = start + n

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """dst := src's positions [0, n) (a prefix-cache hit between slots)."""
        self.reserve(dst, n)
        for tensors in (self.keys, self.values):
            for t in tensors:
                t[dst, :, :n] = t[src, :, :n]
        self.lens[dst] = n

    def rows(self, slot: int, start: int, end: int) -> tuple[list, list]:
        """Per layer [kv_heads, end - start, head_dim] views of the slot's positions."""
        keys = [k[slot, :, start:end] for k in self.keys]
        return keys, [v[slot, :, start:end] for v in self.values]

    def write_step(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k, v) -> None:
        """One new row per slot of a decode step: k, v [B, kv_heads, head_dim]."""
        self.keys[layer][slots, :, positions] = k
        self.values[layer][slots, :, positions] = v

    def step_view(self, layer: int, select: slice | torch.Tensor, length: int):
        """K, V [B, kv_heads, length, head_dim] of a step's slots: views where the slots are a
        contiguous range (`select` a slice), else a copy of just `length` positions."""
        k, v = self.keys[layer][:, :, :length], self.values[layer][:, :, :length]
        if isinstance(select, slice):
            return k[select], v[select]
        return k.index_select(0, select), v.index_select(0, select)

    def mark_step(self, slots: list[int], positions: list[int]) -> None:
        for slot, position in zip(slots, positions):
            self.lens[slot] = position + 1


def _lazy_zeros(shape: tuple[int, ...]) -> torch.Tensor:
    """A bf16 tensor of zeros in its own anonymous private mapping: pages cost memory once
    written, and the mapping is unmapped when the tensor is freed (malloc would keep it)."""
    numel = 1
    for size in shape:
        numel *= size
    if numel == 0:
        return torch.zeros(shape, dtype=BF16)
    pages = mmap.mmap(-1, numel * 2, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=BF16).view(shape)  # the tensor keeps the mapping
