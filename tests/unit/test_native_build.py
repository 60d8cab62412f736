"""The native kernels' build (executors/native_build.py): a shared header is part of every
kernel's cache key, so editing it rebuilds the kernel instead of loading a stale library;
a kernel that does not compile is a one-line reason, not an exception."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from ultrafast.executors import native_build


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on PATH: the kernels are not built here")
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "kernels"
    folder.mkdir()
    monkeypatch.setattr(native_build, "KERNELS", folder)
    (folder / "probe.c").write_text('#include "shared.h"\nint probe(void) { return VALUE; }\n')
    return folder


def probe(library: ctypes.CDLL | str) -> int:
    assert not isinstance(library, str), library
    library.probe.restype = ctypes.c_int
    return library.probe()


def test_editing_a_shared_header_rebuilds_the_kernel(kernels):
    (kernels / "shared.h").write_text("#define VALUE 1\n")
    assert probe(native_build.build_library("probe")) == 1
    (kernels / "shared.h").write_text("#define VALUE 2\n")
    assert probe(native_build.build_library("probe")) == 2


def test_a_kernel_that_does_not_compile_is_a_reason(kernels):
    (kernels / "shared.h").write_text("this is not C\n")
    reason = native_build.build_library("probe")
    assert isinstance(reason, str) and reason.startswith("the kernel did not compile")


def test_the_shipped_kernels_build_with_their_shared_header(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path))
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on PATH: the kernels are not built here")
    for name in ("decode_attention", "fused_ops"):
        assert not isinstance(native_build.build_library(name), str), name
