"""Memory by need on a real llama.cpp context (executors/ggml_memory.py): the KV cache that
llama.cpp allocates and zeroes for every slot up front costs no resident memory until slots
are used, and generation is token for token what it is with the KV fully resident."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from tests.model.fresh_process import child_only, run_in_fresh_process  # noqa: E402
from tests.model.test_ggml_executor import PROMPTS, generate  # noqa: E402
from ultrafast.config import DEMO_MODEL_DIR  # noqa: E402
from ultrafast.executors import ggml_memory  # noqa: E402
from ultrafast.executors.ggml_exec import GgmlExecutor  # noqa: E402
from ultrafast.model.kv_budget import kv_bytes_per_position  # noqa: E402

GGUF = DEMO_MODEL_DIR / "demo-code-f16.gguf"
SLOTS, POSITIONS = 16, 2048


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open() -> tuple[GgmlExecutor, int]:
    before = _rss()
    ex = GgmlExecutor(GGUF, num_slots=SLOTS, max_model_len=POSITIONS, n_threads=1)
    return ex, _rss() - before


def test_the_kv_cache_is_resident_only_where_used_and_tokens_do_not_change():
    """Run in a fresh interpreter: in the suite's process, memory that earlier tests' models
    freed can be mapped again for the KV, which then is no new mapping to release."""
    run_in_fresh_process(__file__, "test_kv_by_need_in_a_fresh_process")


def test_kv_by_need_in_a_fresh_process(monkeypatch):
    child_only()
    monkeypatch.setattr(ggml_memory, "_OPEN", set())
    kv_bytes = kv_bytes_per_position(GGUF, None) * SLOTS * POSITIONS
    assert kv_bytes >= 64 * 2**20  # large enough to tell apart from everything else
    by_need, grew = _open()
    try:
        assert by_need.released_bytes >= 0.9 * kv_bytes
        assert grew < kv_bytes / 2
        tokens = generate(by_need, PROMPTS, 12)
        # a second context while one is open (a second model, a draft): the first one's
        # native threads might write a mapping made meanwhile, so nothing is released
        second, _ = _open()
        assert second.released_bytes == 0
        second.close()
    finally:
        by_need.close()
    # the same context with the KV left resident (as llama.cpp leaves it): it costs the
    # whole KV at once, and generates the same tokens
    monkeypatch.setattr(ggml_memory, "release_zero_pages", lambda ranges, min_bytes=0: 0)
    resident, grew_resident = _open()
    try:
        assert grew_resident >= 0.9 * kv_bytes
        assert generate(resident, PROMPTS, 12) == tokens
    finally:
        resident.close()
