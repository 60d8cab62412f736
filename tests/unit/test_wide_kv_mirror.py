"""The wide decode's KV mirror (executors/wide_kv_mirror.py): rows for every slot from the
first use, capacity grown by need, by half at least, never past `max_len`; every slot's rows
survive a growth; memory is paid for written positions only, and a growth's old copy is
given back."""

from __future__ import annotations

import torch

from ultrafast.executors.wide_kv_mirror import KVMirror


def rows_of(value: float, n: int) -> list[torch.Tensor]:
    return [torch.full((2, n, 4), value + layer, dtype=torch.bfloat16) for layer in range(3)]


def test_growth_by_half_at_least_and_capped():
    mirror = KVMirror(num_layers=3, kv_heads=2, head_dim=4, max_len=1000, max_rows=10)
    mirror.put_rows(3, 0, rows_of(1, 10), rows_of(-1, 10))
    assert (mirror._rows, mirror._capacity) == (10, 64)  # every slot's row at once
    mirror.put_rows(4, 0, rows_of(2, 70), rows_of(-2, 70))  # longer rows
    assert mirror._rows == 10 and mirror._capacity == 128  # 64 + 32 -> a 64 step
    mirror.reserve(9, 999)
    assert mirror._capacity == 1000  # capped at max_len, not rounded past it
    mirror.reserve(12, 10)  # a slot past max_rows still gets its row
    assert mirror._rows == 13
    unbounded = KVMirror(num_layers=1, kv_heads=1, head_dim=4, max_len=64)
    unbounded.reserve(3, 1)
    unbounded.reserve(4, 1)
    assert unbounded._rows == 6  # no slot count: by half at least


def test_rows_survive_a_growth():
    mirror = KVMirror(num_layers=3, kv_heads=2, head_dim=4, max_len=512, max_rows=8)
    mirror.put_rows(0, 0, rows_of(1, 50), rows_of(-1, 50))
    mirror.put_rows(5, 0, rows_of(7, 200), rows_of(-7, 200))  # grows both sizes
    keys, values = mirror.rows(0, 0, 50)
    for layer in range(3):
        assert torch.equal(keys[layer], rows_of(1, 50)[layer])
        assert torch.equal(values[layer], rows_of(-1, 50)[layer])
    assert mirror.length(0) == 50 and mirror.length(5) == 200


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(row for row in status if row.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_only_written_positions_cost_memory_and_a_growth_gives_the_old_copy_back():
    # at 2,048 positions: 32 rows x 2 heads x 64 dims x 2 bytes x 8 layers x K and V = 256 MiB
    # if every position were paged in; one slot's 100 positions are ~1 MiB
    ones = [torch.ones(2, 100, 64, dtype=torch.bfloat16)] * 8
    mirror = KVMirror(num_layers=8, kv_heads=2, head_dim=64, max_len=2048, max_rows=32)
    before = resident_mib()
    mirror.put_rows(5, 0, ones, ones)
    for end in (600, 1000, 1500, 2048):  # growths: each copies slot 5, then unmaps the old
        mirror.reserve(0, end)
    assert mirror._capacity == 2048
    assert resident_mib() - before < 32
    keys, values = mirror.rows(5, 0, 100)
    assert all(torch.equal(t, ones[0]) for t in keys + values)
    assert float(mirror.keys[0][6].abs().sum()) == 0.0  # unwritten rows read as zeros
