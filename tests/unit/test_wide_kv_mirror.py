"""The wide decode's KV mirror (executors/wide_kv_mirror.py): it grows by need, by half at
least in both sizes (every growth copies all of it), never past the slot count or
`max_len`, and keeps every slot's rows across a growth."""

from __future__ import annotations

import torch

from ultrafast.executors.wide_kv_mirror import KVMirror


def rows_of(value: float, n: int) -> list[torch.Tensor]:
    return [torch.full((2, n, 4), value + layer, dtype=torch.bfloat16) for layer in range(3)]


def test_growth_by_half_at_least_and_capped():
    mirror = KVMirror(num_layers=3, kv_heads=2, head_dim=4, max_len=1000, max_rows=10)
    mirror.put_rows(3, 0, rows_of(1, 10), rows_of(-1, 10))
    assert (mirror._rows, mirror._capacity) == (4, 64)
    mirror.put_rows(4, 0, rows_of(2, 70), rows_of(-2, 70))  # one more slot, longer rows
    assert mirror._rows == 6 and mirror._capacity == 128  # 4 + 2, 64 + 32 -> a 64 step
    mirror.put_rows(9, 0, rows_of(3, 5), rows_of(-3, 5))
    assert mirror._rows == 10  # 6 + 3 = 9 < 10 = slot + 1, within max_rows
    mirror.reserve(9, 999)
    assert mirror._capacity == 1000  # capped at max_len, not rounded past it
    mirror.reserve(12, 10)  # a slot past max_rows still gets its row
    assert mirror._rows == 13


def test_rows_survive_a_growth():
    mirror = KVMirror(num_layers=3, kv_heads=2, head_dim=4, max_len=512, max_rows=8)
    mirror.put_rows(0, 0, rows_of(1, 50), rows_of(-1, 50))
    mirror.put_rows(5, 0, rows_of(7, 200), rows_of(-7, 200))  # grows both sizes
    keys, values = mirror.rows(0, 0, 50)
    for layer in range(3):
        assert torch.equal(keys[layer], rows_of(1, 50)[layer])
        assert torch.equal(values[layer], rows_of(-1, 50)[layer])
    assert mirror.length(0) == 50 and mirror.length(5) == 200
