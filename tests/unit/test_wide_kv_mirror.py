"""The wide decode's KV mirror (executors/wide_kv_mirror.py): rows for every slot and
FIRST_CAPACITY positions (at most `max_len`) from the first use, then capacity grown by need,
by half at least, never past `max_len`; every slot's rows survive a growth; memory is paid for
written positions only, and a growth's old copy is given back."""

from __future__ import annotations

import torch

from ultrafast.executors.wide_kv_mirror import KVMirror


def rows_of(value: float, n: int) -> list[torch.Tensor]:
    return [torch.full((2, n, 4), value + layer, dtype=torch.bfloat16) for layer in range(3)]


def test_growth_by_half_at_least_and_capped():
    from ultrafast.executors.wide_kv_mirror import FIRST_CAPACITY

    mirror = KVMirror(num_layers=3, kv_heads=2, head_dim=4, max_len=5000, max_rows=10)
    mirror.put_rows(3, 0, rows_of(1, 10), rows_of(-1, 10))
    # every slot's row and FIRST_CAPACITY positions at once: no growth until a longer one
    assert (mirror._rows, mirror._capacity) == (10, FIRST_CAPACITY) == (10, 2048)
    mirror.put_rows(4, 0, rows_of(2, 1500), rows_of(-2, 1500))  # within it: no growth
    assert mirror._capacity == 2048
    mirror.reserve(4, 2100)
    assert mirror._capacity == 3072  # by half at least
    mirror.reserve(9, 4999)
    assert mirror._capacity == 5000  # capped at max_len, not rounded past it
    mirror.reserve(12, 10)  # a slot past max_rows still gets its row
    assert mirror._rows == 13
    small = KVMirror(num_layers=1, kv_heads=1, head_dim=4, max_len=300, max_rows=2)
    small.reserve(0, 5)
    assert small._capacity == 300  # FIRST_CAPACITY capped at max_len
    unbounded = KVMirror(num_layers=1, kv_heads=1, head_dim=4, max_len=64)
    unbounded.reserve(3, 1)
    unbounded.reserve(4, 1)
    assert unbounded._rows == 6  # no slot count: by half at least


def test_rows_survive_a_growth():
    mirror = KVMirror(num_layers=3, kv_heads=2, head_dim=4, max_len=5000, max_rows=8)
    mirror.put_rows(0, 0, rows_of(1, 50), rows_of(-1, 50))
    mirror.put_rows(5, 0, rows_of(7, 2200), rows_of(-7, 2200))  # grows the capacity
    keys, values = mirror.rows(0, 0, 50)
    for layer in range(3):
        assert torch.equal(keys[layer], rows_of(1, 50)[layer])
        assert torch.equal(values[layer], rows_of(-1, 50)[layer])
    assert mirror.length(0) == 50 and mirror.length(5) == 2200 and mirror._capacity > 2048


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(row for row in status if row.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_only_written_positions_cost_memory_and_a_growth_gives_the_old_copy_back():
    # at 6,144 positions: 32 rows x 2 heads x 64 dims x 2 bytes x 8 layers x K and V = 768 MiB
    # if every position were paged in; one slot's 100 positions are ~1 MiB
    ones = [torch.ones(2, 100, 64, dtype=torch.bfloat16)] * 8
    mirror = KVMirror(num_layers=8, kv_heads=2, head_dim=64, max_len=6144, max_rows=32)
    before = resident_mib()
    mirror.put_rows(5, 0, ones, ones)
    assert resident_mib() - before < 32  # 2,048 positions mapped, 100 written
    for end in (3000, 4500, 6144):  # growths: each copies slot 5, then unmaps the old
        mirror.reserve(0, end)
    assert mirror._capacity == 6144
    assert resident_mib() - before < 32
    keys, values = mirror.rows(5, 0, 100)
    assert all(torch.equal(t, ones[0]) for t in keys + values)
    assert float(mirror.keys[0][6].abs().sum()) == 0.0  # unwritten rows read as zeros
