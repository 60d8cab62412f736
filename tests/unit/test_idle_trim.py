"""IdleTrim: freed memory goes back once, after an idle stretch, and the engine thread asks."""

import ctypes
import subprocess
import sys
import threading

import pytest

from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.engine.idle_trim import IdleTrim
from ultrafast.engine.thread import EngineThread
from ultrafast.executors.fake_exec import FakeExecutor
from ultrafast.request import Request, SamplingParams


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_trim_is_due_once_per_idle_stretch_and_only_after_it():
    clock, calls = Clock(), []
    trim = IdleTrim(trim=lambda: calls.append(1) or True, idle_s=10.0, clock=clock)
    clock.now += 9.9
    assert not trim.due()  # the warm-up's memory waits for the same stretch
    clock.now += 0.2
    assert trim.due()
    trim.run()
    clock.now += 60
    assert not trim.due() and calls == [1]  # nothing freed since: no second trim
    trim.busy()
    clock.now += 5
    assert not trim.due()  # a step 5 s ago: a steady stream is not trimmed
    clock.now += 5
    assert trim.due()
    trim.run()
    assert trim.trims == 2 and calls == [1, 1]


def _is_glibc():
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except AttributeError:
        return False
    return True


FRAGMENTED_HEAP = """
import ctypes, sys
from ultrafast.heap_trim import glibc_trim
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
blocks = [libc.malloc(64 << 10) for _ in range(3000)]  # under the mmap threshold: the heap
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks[:-1]:  # the last one keeps the heap's top: glibc gives back nothing by itself
    libc.free(b)
before = rss_mib()
released = glibc_trim()
print(released, before - rss_mib())
"""


@pytest.mark.skipif(not _is_glibc(), reason="malloc_trim is glibc's; other C libraries skip it")
def test_glibc_trim_gives_back_the_free_pages_between_live_blocks():
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "True"
    assert float(out[1]) > 150  # of the ~187 MiB freed inside the heap


def test_the_engine_thread_trims_after_its_requests_and_an_idle_stretch():
    trimmed = threading.Event()
    trim = IdleTrim(trim=lambda: trimmed.set() or True, idle_s=0.3)
    executor = FakeExecutor(num_slots=2, step_s=0.002)
    core = EngineCore(executor, SchedulerConfig(max_num_seqs=2, max_model_len=256))
    engine = EngineThread(core, idle_trim=trim).start()
    assert trimmed.wait(5)  # the start's own stretch
    trimmed.clear()
    done = threading.Event()
    engine.submit(
        Request("r", [1, 2], SamplingParams(temperature=0, max_tokens=4)),
        lambda out: out.finished and done.set(),
    )
    assert done.wait(5)
    assert trimmed.wait(5) and trim.trims == 2
    engine.stop()
