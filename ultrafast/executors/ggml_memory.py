"""KV memory by need: the ggml executor's KV cache takes host memory only where it is used.

llama.cpp allocates every slot's KV stream up front and clears it to zero, which touches every
page: the default SmolLM2 held 1.26 GiB of zeros for 28 slots before its first request. A page
of an anonymous private mapping that holds only zeros can be handed back to the kernel
(madvise MADV_DONTNEED) with no change a reader could see: its next read gets a zero page and
its next write a fresh zeroed one. So right after the context is created, the all-zero pages of
the large anonymous mappings that appeared while it was created (the KV buffer; also the
compute and logits buffers, which are rewritten by every pass) are released, and a slot's KV
comes back page by page as its positions are written. The slot count stays as configured.

Safety: only mappings new since `snapshot()` and at least MIN_REGION_BYTES long are looked at
(other threads' small allocations are not), and each chunk is compared with zeros and released
with the GIL held (memcmp and madvise through ctypes.PyDLL), so no Python thread writes between
the check and the release; the executor's native threads are idle while its constructor runs.
`serve`'s head start creates the context on a thread of its own while another thread imports
the server (executors/ggml_open.py): the new ranges are taken right after the creation, on
that thread, and compared and released later by the executor that adopts the context, on the
engine-building thread, once the opening thread has ended, and only where they are still
anonymous mappings then (`still_mapped`: the importer may have unmapped some meanwhile, and
reading one would fault); the threads running then (the importer, the event loop) write
memory only while holding the GIL.
Another context already open in this process (a second resident model, a draft model) could
have its native threads write a mapping it makes meanwhile (llama.cpp grows its logits buffer
during a decode): then nothing is released (`opening` returns no snapshot).
"""

from __future__ import annotations

import ctypes
import os
import threading

MADV_DONTNEED = 4
MIN_REGION_BYTES = 32 * 2**20  # the KV buffers of interest are far larger
CHUNK_BYTES = 2**20  # compared and released whole when all zero; else page by page
_PAGE = os.sysconf("SC_PAGE_SIZE")


def anonymous_ranges(maps_text: str | None = None) -> list[tuple[int, int]]:
    """[start, end) of every private read-write mapping without a file (heap-like memory)."""
    if maps_text is None:
        with open("/proc/self/maps") as f:
            maps_text = f.read()
    out: list[tuple[int, int]] = []
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5 or parts[1] != "rw-p" or (len(parts) == 6 and parts[5].strip()):
            continue
        start, _, end = parts[0].partition("-")
        out.append((int(start, 16), int(end, 16)))
    return out


def new_ranges(
    before: list[tuple[int, int]], after: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The parts of `after`'s ranges that no range of `before` covered."""
    out: list[tuple[int, int]] = []
    for start, end in after:
        pieces = [(start, end)]
        for b_start, b_end in before:
            cut = []
            for s, e in pieces:
                if b_end <= s or e <= b_start:
                    cut.append((s, e))
                    continue
                if s < b_start:
                    cut.append((s, b_start))
                if b_end < e:
                    cut.append((b_end, e))
            pieces = cut
        out.extend(p for p in pieces if p[1] > p[0])
    return out


def _libc():
    """madvise and memcmp called with the GIL held (PyDLL), so no Python thread runs between
    a chunk's check and its release."""
    libc = ctypes.PyDLL(None, use_errno=True)
    madvise, memcmp = libc.madvise, libc.memcmp
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcmp.restype = ctypes.c_int
    return madvise, memcmp


def release_zero_pages(ranges: list[tuple[int, int]], min_bytes: int = MIN_REGION_BYTES) -> int:
    """Release every all-zero page of the ranges at least `min_bytes` long; bytes released."""
    madvise, memcmp = _libc()
    zeros = ctypes.create_string_buffer(CHUNK_BYTES)  # compared in place: no copy of a chunk
    released = 0
    for start, end in ranges:
        if end - start < min_bytes:
            continue
        start = (start + _PAGE - 1) // _PAGE * _PAGE
        for chunk in range(start, end, CHUNK_BYTES):
            size = min(CHUNK_BYTES, end - chunk)
            if memcmp(chunk, zeros, size) == 0:
                released += size if madvise(chunk, size, MADV_DONTNEED) == 0 else 0
                continue
            for page in range(chunk, chunk + size - _PAGE + 1, _PAGE):
                if memcmp(page, zeros, _PAGE) == 0:
                    released += _PAGE if madvise(page, _PAGE, MADV_DONTNEED) == 0 else 0
    return released


_OPEN: set[int] = set()  # id() of every executor holding a llama.cpp context here
_OPEN_LOCK = threading.Lock()


def opening(owner: object) -> list[tuple[int, int]] | None:
    """`owner` is about to create a context: the mappings to release against afterwards, or
    None when another context of this process is open (nothing will be released)."""
    with _OPEN_LOCK:
        alone = not _OPEN
        _OPEN.add(id(owner))
    return snapshot() if alone else None


def closed(owner: object) -> None:
    with _OPEN_LOCK:
        _OPEN.discard(id(owner))


def snapshot() -> list[tuple[int, int]] | None:
    """The anonymous mappings now (None where /proc is not there: nothing is released)."""
    try:
        return anonymous_ranges()
    except OSError:
        return None


def still_mapped(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `ranges` that are anonymous mappings now: ranges taken earlier may have
    been unmapped since (reading them would fault) or mapped as something else."""
    now = snapshot()
    if now is None or not ranges:
        return []
    gone = new_ranges(now, ranges)  # the parts of `ranges` that no mapping covers now
    return new_ranges(gone, ranges) if gone else list(ranges)


def new_since(before: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """The parts of the anonymous mappings now that `before` did not cover ([] for None)."""
    after = None if before is None else snapshot()
    return [] if before is None or after is None else new_ranges(before, after)
