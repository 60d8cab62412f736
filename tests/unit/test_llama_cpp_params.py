"""The llama.cpp load parameters: extra buffer types (AMX repacking) off where they crash."""

import pytest

pytest.importorskip("llama_cpp")

from ultrafast.executors import llama_cpp_params as lp  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_choice():
    lp.extra_buffers_safe.cache_clear()
    yield
    lp.extra_buffers_safe.cache_clear()


def test_the_environment_forces_extra_buffers_off_and_on(monkeypatch):
    monkeypatch.setenv("ULTRAFAST_GGML_EXTRA_BUFFERS", "0")
    assert lp.model_params().use_extra_bufts is False
    lp.extra_buffers_safe.cache_clear()
    monkeypatch.setenv("ULTRAFAST_GGML_EXTRA_BUFFERS", "1")
    assert lp.model_params().use_extra_bufts is True


def test_cpus_with_amx_load_without_extra_buffers(monkeypatch):
    monkeypatch.delenv("ULTRAFAST_GGML_EXTRA_BUFFERS", raising=False)
    with open("/proc/cpuinfo") as f:
        has_amx = "amx_int8" in next(line for line in f if line.startswith("flags")).split()
    assert lp.model_params().use_extra_bufts is (not has_amx)


def test_open_llama_leaves_the_library_default_alone(monkeypatch):
    import llama_cpp.llama_cpp as lib

    monkeypatch.setenv("ULTRAFAST_GGML_EXTRA_BUFFERS", "0")
    with lp._patched_defaults():
        assert lib.llama_model_default_params().use_extra_bufts is False
    assert lib.llama_model_default_params().use_extra_bufts is True
