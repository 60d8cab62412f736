"""KV memory by need (executors/ggml_memory.py): all-zero pages of a large new anonymous
mapping go back to the kernel; every byte reads as before, and the memory is resident again
only where it is written."""

import ctypes
import mmap

from ultrafast.executors import ggml_memory

MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_zero_pages_are_released_and_every_byte_reads_the_same():
    size = 64 * MIB
    region = mmap.mmap(-1, size)  # anonymous, private to this test
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    region.write(b"\0" * size)  # touched: resident, like llama.cpp's cleared KV buffer
    region[5 * MIB + 100 : 5 * MIB + 104] = b"live"  # one page holds data
    region[size - 3 :] = b"end"  # and the last one
    before = _rss_bytes()
    released = ggml_memory.release_zero_pages([(address, address + size)], min_bytes=0)
    assert released >= size - 3 * mmap.PAGESIZE and released <= size - 2 * mmap.PAGESIZE
    assert before - _rss_bytes() >= 48 * MIB  # the kernel took the pages back
    assert region[5 * MIB + 100 : 5 * MIB + 104] == b"live" and region[size - 3 :] == b"end"
    assert region[:MIB].count(0) == MIB and region[40 * MIB : 41 * MIB].count(0) == MIB
    region[40 * MIB] = 7  # a released page is writable again, zero around the write
    assert region[40 * MIB] == 7 and region[40 * MIB + 1] == 0


def test_only_large_ranges_new_since_the_snapshot_are_candidates():
    maps = (
        "7f0000000000-7f0000100000 rw-p 00000000 00:00 0 \n"
        "7f0000100000-7f0000200000 r--p 00000000 fe:00 12 /usr/lib/libc.so.6\n"
        "7f0000300000-7f0004300000 rw-p 00000000 00:00 0 [heap]\n"
        "7f0005000000-7f0009000000 rw-p 00000000 00:00 0\n"
    )
    ranges = ggml_memory.anonymous_ranges(maps)
    assert ranges == [(0x7F0000000000, 0x7F0000100000), (0x7F0005000000, 0x7F0009000000)]
    before = [(0x7F0005000000, 0x7F0006000000)]
    # the old part of a merged mapping is never touched, only what appeared since
    assert ggml_memory.new_ranges(before, ranges) == [
        (0x7F0000000000, 0x7F0000100000),
        (0x7F0006000000, 0x7F0009000000),
    ]
    # too small: never read (address 0 would fault if it were)
    assert ggml_memory.release_zero_pages([(0, 4096)], min_bytes=MIB) == 0


def test_nothing_is_released_without_a_snapshot():
    assert ggml_memory.new_since(None) == []  # no snapshot (another context open): nothing
    assert ggml_memory.release_zero_pages([]) == 0


def test_ranges_taken_earlier_are_released_only_where_still_mapped():
    """An early open's ranges are released seconds after they were taken (ggml_open.py):
    a range unmapped meanwhile must not be read (it would fault)."""
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # as malloc's: rw-p, no file
    kept, gone = (mmap.mmap(-1, 40 * MIB, flags=private) for _ in range(2))
    ranges = []
    for region in (kept, gone):
        view = ctypes.c_char.from_buffer(region)
        address = ctypes.addressof(view)
        del view  # (an exported buffer cannot be closed)
        ranges.append((address, address + 40 * MIB))
        region.write(b"\0" * (40 * MIB))
    gone.close()
    assert ggml_memory.still_mapped(ranges) == [ranges[0]]
    assert ggml_memory.release_zero_pages(ggml_memory.still_mapped(ranges), min_bytes=0) > 0
    kept.close()
