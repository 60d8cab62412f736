"""`serve`'s head start (ultrafast/early_open.py, executors/ggml_open.py): the llama.cpp model
and context opened on another thread are adopted by the executor that asks for exactly their
parameters, which then decodes token for token as one that opened its own; anything else is
closed, and the engine sizes and opens as always."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("llama_cpp")

from tests.model.fresh_process import child_only, run_in_fresh_process  # noqa: E402
from tests.model.test_ggml_executor import PROMPTS, generate  # noqa: E402
from ultrafast import early_open  # noqa: E402
from ultrafast.config import DEMO_MODEL_DIR, EngineConfig  # noqa: E402
from ultrafast.engine_sizing import sized  # noqa: E402
from ultrafast.executors import ggml_memory, ggml_open  # noqa: E402
from ultrafast.executors.ggml_exec import GgmlExecutor  # noqa: E402
from ultrafast.model.kv_budget import kv_bytes_per_position  # noqa: E402

GGUF = DEMO_MODEL_DIR / "demo-code-f16.gguf"
ARGS = {"num_slots": 4, "max_model_len": 256, "n_threads": 1}


def _open_early(**args) -> ggml_open.EarlyOpen:
    early = ggml_open.register_early(ggml_open.OpenParams.of(GGUF, **args))
    threading.Thread(target=early.run).start()
    return early


def test_the_executor_adopts_an_early_open_and_decodes_as_its_own():
    early = _open_early(**ARGS)
    adopted = GgmlExecutor(GGUF, **ARGS)
    try:
        assert adopted._opened is early.result()  # no second model was loaded
        assert adopted._ctx is not None and adopted.vocab_size > 0
        tokens = generate(adopted, PROMPTS, 10)
    finally:
        adopted.close()
    assert early.result() is not None and early.result().ctx is None  # closed with it
    own = GgmlExecutor(GGUF, **ARGS)
    try:
        assert generate(own, PROMPTS, 10) == tokens
    finally:
        own.close()


def test_an_early_open_with_other_parameters_is_closed_not_adopted():
    early = _open_early(**{**ARGS, "num_slots": 2})
    own = GgmlExecutor(GGUF, **ARGS)
    try:
        assert own._opened is not early.result()
        assert early.result() is not None and early.result().ctx is None
        assert own.num_slots == 4
    finally:
        own.close()


def test_an_early_open_that_fails_leaves_the_executor_to_open_and_report():
    early = ggml_open.register_early(ggml_open.OpenParams.of(__file__, **ARGS))
    early.run()  # not a GGUF: llama.cpp cannot load it
    assert early.result() is None
    with pytest.raises(Exception, match="could not load"):
        GgmlExecutor(__file__, **ARGS)


def test_the_head_start_sizes_once_for_the_same_config_and_discards_what_was_not_used():
    config = EngineConfig(model=str(GGUF), num_slots=2, max_model_len=128, n_threads=1)
    early_open.start(config)
    assert early_open.sized_for(EngineConfig(model=str(GGUF))) is None  # another config
    head = early_open._head_start
    assert head is not None
    got = early_open.sized_for(config)
    assert got is not None and got[0] == sized(config)[0]
    assert early_open.sized_for(config) is None  # the first engine only
    pending = ggml_open._early
    assert pending is not None and pending.params.num_slots == 2
    early_open.discard()  # no executor adopted it
    assert ggml_open._early is None
    opened = pending.result()
    assert opened is not None and opened.ctx is None


def test_an_adopted_context_still_hands_its_zeroed_kv_back():
    """In a fresh interpreter, as test_kv_by_need.py: there the KV is a new mapping."""
    run_in_fresh_process(__file__, "test_kv_released_after_an_early_open_in_a_fresh_process")


def test_kv_released_after_an_early_open_in_a_fresh_process(monkeypatch):
    child_only()
    monkeypatch.setattr(ggml_memory, "_OPEN", set())
    slots, positions = 16, 2048
    kv_bytes = kv_bytes_per_position(GGUF, None) * slots * positions
    args = {"num_slots": slots, "max_model_len": positions, "n_threads": 1}
    early = _open_early(**args)
    early.result()
    with_thread_busy = threading.Thread(target=lambda: sum(range(3_000_000)))
    with_thread_busy.start()  # the importing thread's stand-in, writing under the GIL
    adopted = GgmlExecutor(GGUF, **args)
    with_thread_busy.join()
    try:
        assert adopted._opened is early.result()
        assert adopted.released_bytes >= 0.9 * kv_bytes
        assert generate(adopted, PROMPTS, 8)
    finally:
        adopted.close()


def test_the_engine_serve_builds_adopts_the_head_start():
    """As `serve` does: the head start begins at the bind, then `build_engine` takes its
    sizing and its executor the opened model (no second load)."""
    from ultrafast.llm import build_engine

    config = EngineConfig(
        model=str(GGUF), num_slots=2, max_model_len=128, n_threads=1, wide_pass="off"
    )
    early_open.start(config)
    head = early_open._head_start
    assert head is not None and head.ready.wait(30)
    pending = ggml_open._early
    assert pending is not None  # registered before the sizing was handed over
    core, _, _ = build_engine(config)
    try:
        assert head.taken and ggml_open._early is None
        assert core.executor._opened is pending.result()  # adopted: no second load
    finally:
        early_open.discard()
        core.close()
