"""Run one test of a file in a fresh interpreter: memory figures (RSS growth) taken in the
suite's process are blurred by what earlier tests' models freed and the allocator reuses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = "ULTRAFAST_FRESH_PROCESS_CHILD"


def in_child() -> bool:
    return bool(os.environ.get(CHILD))


def run_in_fresh_process(test_file: str, name: str) -> None:
    """The parent's side: run `test_file::name` in a new pytest process; it must pass."""
    if in_child():
        pytest.skip("the child runs the check itself")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{test_file}::{name}"],
        env={**os.environ, CHILD: "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:]


def child_only() -> None:
    """The child's side: skip unless run by run_in_fresh_process."""
    if not in_child():
        pytest.skip("run by its parent test, in its own process")
