"""A bf16 GGUF served from its exact float16 copy (executors/f16_twin.py): made only when
every value reads back equal and no matmul input can leave float16's range, used only where
measured faster, the choice cached; the copy's greedy tokens are the file's (or near-ties)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.model.test_wide_pass import (  # noqa: E402
    assert_near_ties,
    generate,
    smollm2_bf16,
    text_prompts,
)
from ultrafast.executors import f16_twin
from ultrafast.executors.ggml_exec import GgmlExecutor

SMALLEST_EXACT = 2.0**-14  # float16's smallest normal: bf16 values from here up are exact


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path / "cache"))
    f16_twin._chosen.clear()
    yield
    f16_twin._chosen.clear()


def _rewritten(hf_dir: Path, out: Path, change) -> Path:
    """A copy of an HF checkpoint whose float32 weights `change(name, tensor)` rewrote."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, out)
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    with torch.no_grad():
        for name, tensor in tensors.items():
            change(name, tensor)
    save_file(tensors, weights, metadata={"format": "pt"})
    return out


def _on_both_grids(name, tensor) -> None:
    """Round to bf16 and drop what float16 could not hold: the values then fit both."""
    import torch

    tensor.copy_(tensor.to(torch.bfloat16).float())
    tensor[tensor.abs() < SMALLEST_EXACT] = 0.0


def _bf16_gguf(make_tiny_hf_dir, tmp_path, change) -> Path:
    from ultrafast.convert import convert_hf_to_gguf

    hf = _rewritten(make_tiny_hf_dir("llama"), tmp_path / "hf", change)
    return convert_hf_to_gguf(hf, tmp_path / "tiny-bf16.gguf", "bf16")


@pytest.fixture
def exact_bf16(make_tiny_hf_dir, tmp_path) -> Path:
    return _bf16_gguf(make_tiny_hf_dir, tmp_path, _on_both_grids)


def _greedy(path: Path, weights: Path, batch) -> tuple[list, list]:
    with GgmlExecutor(
        path, num_slots=len(batch), max_model_len=128, n_threads=1, weights_path=weights
    ) as ex:
        assert ex.weights_path == weights and ex.gguf_path == path
        return generate(ex, batch)


def test_an_exact_file_gets_an_equal_float16_copy_with_the_same_tokens(exact_bf16):
    twin, why = f16_twin.checked_twin(exact_bf16, threads=1)
    assert twin is not None and twin.is_file(), why
    assert why.startswith("exact")
    assert f16_twin.first_difference(exact_bf16, twin) is None
    copied = f16_twin._File(twin)
    matrices = [t for t in copied.meta.tensors if len(t.shape) > 1]
    assert matrices and all(t.ggml_type == f16_twin.GGML_F16 for t in matrices)
    rng = np.random.default_rng(3)
    batch = [rng.integers(3, 200, size=12 + 3 * i).tolist() for i in range(4)]
    want, margins = _greedy(exact_bf16, exact_bf16, batch)
    got, _ = _greedy(exact_bf16, twin, batch)
    assert_near_ties(want, got, margins)


def test_a_value_float16_cannot_hold_keeps_the_file(make_tiny_hf_dir, tmp_path):
    def one_tiny_value(name, tensor):
        _on_both_grids(name, tensor)
        if name.endswith("mlp.up_proj.weight") and ".1." in name:
            tensor.view(-1)[5] = 3.0e-7  # a bf16 value off float16's subnormal grid

    path = _bf16_gguf(make_tiny_hf_dir, tmp_path, one_tiny_value)
    twin, why = f16_twin.checked_twin(path, threads=1)
    assert twin is None
    assert why == "the float16 copy's blk.1.ffn_up.weight differs from the file's"
    assert not f16_twin.twin_path(path).exists()  # the unequal copy is not left behind


def test_an_input_past_float16s_range_keeps_the_file(make_tiny_hf_dir, tmp_path):
    def huge_norm(name, tensor):
        _on_both_grids(name, tensor)
        if name.endswith("post_attention_layernorm.weight"):
            tensor.fill_(4096.0)  # normed inputs up to sqrt(d) * 4096

    path = _bf16_gguf(make_tiny_hf_dir, tmp_path, huge_norm)
    twin, why = f16_twin.checked_twin(path, threads=1)
    assert twin is None and "past float16's range" in why


def test_the_bound_holds_every_matmul_input_of_the_forward(make_tiny_hf_dir, exact_bf16):
    """The weights-only bound against the inputs every Linear of the HF forward sees, over
    random and repeated-token prompts (a bound that forgot a norm's scale fails here)."""
    import torch
    from transformers import AutoModelForCausalLM

    bound = f16_twin.matmul_input_bound(f16_twin._File(exact_bf16))
    assert bound is not None and 0 < bound < f16_twin.F16_MAX
    model = AutoModelForCausalLM.from_pretrained(make_tiny_hf_dir("llama")).eval()
    seen: list[float] = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: seen.append(float(args[0].abs().max())))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    batches = [rng.integers(0, vocab, size=(4, 48)), np.full((1, 48), 7)]
    with torch.no_grad():
        for ids in batches:
            model(torch.as_tensor(ids))
    for hook in hooks:
        hook.remove()
    # the HF weights are the unrounded ones: within bf16's rounding of the bound
    assert seen and max(seen) <= bound * 1.02
    assert max(seen) > bound / 1e4  # the hooks saw real inputs


class _Layer:
    """One llama layer's norms and matrices, as `f16_twin._File` serves them."""

    def __init__(self, **tensors):
        self.tensors = {f"blk.0.{k}.weight": v for k, v in tensors.items()}

    def vector(self, name):
        return self.tensors.get(name)

    def matrix(self, name):
        return self.tensors[name]


def test_the_down_input_bound_is_reached_and_never_passed():
    """The gate * up bound is attained by the normed vector between the two rows (so a wrong
    factor fails) and no normed input passes it (nor any other matmul input's bound)."""
    rng = np.random.default_rng(5)
    d = 8
    gamma = rng.uniform(0.5, 2.0, d).astype(np.float32)
    gate, up = rng.normal(0, 3, (1, d)).astype(np.float32), rng.normal(0, 3, (1, d))
    layer = _Layer(
        attn_norm=np.ones(d, np.float32),
        ffn_norm=gamma,
        attn_v=np.full((1, d), 1e-3, np.float32),
        ffn_gate=gate,
        ffn_up=up.astype(np.float32),
    )
    bound = f16_twin._layer_bound(layer, "blk.0.", float(np.sqrt(d)))
    a, b = (gate * gamma)[0], (up * gamma)[0]
    best = a / np.linalg.norm(a) + np.sign(a @ b) * b / np.linalg.norm(b)
    n = np.sqrt(d) * best / np.linalg.norm(best)  # RMS 1, the direction of the maximum
    assert abs(float((a @ n) * (b @ n))) == pytest.approx(bound, rel=1e-4)
    for _ in range(2000):
        n = rng.normal(size=d)
        n *= np.sqrt(d) / np.linalg.norm(n)  # what RMSNorm makes of any residual
        g, u = a @ n, b @ n
        assert abs(g / (1 + np.exp(-g)) * u) <= bound and np.abs(gamma * n).max() <= bound


def _timed(twin_prefill: float, twin_decode: float) -> dict:
    return {
        "source": {"prefill_ms": 100.0, "decode_ms": 50.0},
        "twin": {"prefill_ms": twin_prefill, "decode_ms": twin_decode},
    }


def test_the_copy_is_used_where_measured_faster_and_the_choice_is_cached(exact_bf16, monkeypatch):
    calls = []

    def timing(*args, **kwargs):
        calls.append(args)
        return _timed(80.0, 45.0)

    monkeypatch.setattr(f16_twin, "time_files", timing)
    choice = f16_twin.choose_weights(exact_bf16, 4, 1, True)
    assert choice.weights == f16_twin.twin_path(exact_bf16) and "float16 copy" in choice.why
    assert len(calls) == 1
    f16_twin._chosen.clear()  # a new process: the cache answers, nothing is timed
    monkeypatch.setattr(f16_twin, "time_files", lambda *a, **k: pytest.fail("timed again"))
    assert f16_twin.choose_weights(exact_bf16, 4, 1, True) == choice
    f16_twin._chosen.clear()  # the copy lost: checked and timed again, not trusted blindly
    f16_twin.twin_path(exact_bf16).unlink()
    monkeypatch.setattr(f16_twin, "time_files", timing)
    assert f16_twin.choose_weights(exact_bf16, 4, 1, True).weights.is_file()
    assert len(calls) == 2


@pytest.mark.parametrize(
    "twin_prefill, twin_decode",
    [(99.0, 49.0), (60.0, 55.0)],  # barely faster; much faster prefill but slower decode
)
def test_the_file_stays_where_the_copy_is_not_clearly_faster(
    exact_bf16, monkeypatch, twin_prefill, twin_decode
):
    monkeypatch.setattr(f16_twin, "time_files", lambda *a, **k: _timed(twin_prefill, twin_decode))
    choice = f16_twin.choose_weights(exact_bf16, 4, 1, True)
    assert choice.weights == exact_bf16 and "ran no faster" in choice.why


def test_other_files_and_off_are_not_looked_at(make_tiny_gguf, exact_bf16, monkeypatch):
    monkeypatch.setattr(f16_twin, "time_files", lambda *a, **k: pytest.fail("timed"))
    f32 = make_tiny_gguf("llama", "f32")
    assert f16_twin.choose_weights(f32, 4, 1, True) == f16_twin.TwinChoice(f32, "")
    off = f16_twin.choose_weights(exact_bf16, 4, 1, True, mode="off")
    assert off.weights == exact_bf16 and "--f16-twin off" in off.why
    assert not f16_twin.twin_path(exact_bf16).exists()


def test_the_measurement_times_both_files_on_llama_cpp(exact_bf16):
    twin, _ = f16_twin.checked_twin(exact_bf16, threads=1)
    assert twin is not None
    timed = f16_twin.time_files(exact_bf16, twin, width=2, threads=1, flash_attn=True, rounds=1)
    for name in ("source", "twin"):
        assert timed[name]["prefill_ms"] > 0 and timed[name]["decode_ms"] > 0


def test_smollm2_bf16_twin_is_exact_bounded_and_greedy_equal():
    """SmolLM2's bf16 file: every value exact in float16, matmul inputs provably under
    65,504; greedy tokens on 10 held-out text prompts x 32 equal the file's or near-ties."""
    path = smollm2_bf16()
    twin, why = f16_twin.checked_twin(path, threads=2)
    assert twin is not None, why
    batch = text_prompts(path)
    want, margins = _greedy(path, path, batch)
    got, _ = _greedy(path, twin, batch)
    assert_near_ties(want, got, margins)


def test_the_engine_loads_the_copy_it_chose_and_off_loads_the_file(exact_bf16, monkeypatch):
    from dataclasses import replace

    from ultrafast.config import EngineConfig
    from ultrafast.engine.read_api import llama_weights
    from ultrafast.engine_sizing import ggml_executor_args, sized
    from ultrafast.llm import build_executor

    monkeypatch.setattr(f16_twin, "time_files", lambda *a, **k: _timed(80.0, 45.0))
    config, files = sized(
        EngineConfig(model=str(exact_bf16), num_slots=2, max_model_len=128, wide_pass="off")
    )
    path, args = ggml_executor_args(config, files)
    twin = f16_twin.twin_path(exact_bf16)
    assert path == exact_bf16 and args["weights_path"] == twin
    executor = build_executor(config, files)
    try:
        assert executor.weights_path == twin and executor.gguf_path == exact_bf16
        assert executor.cost_identity()["weights"] == twin.name  # its own measured costs
        shown = llama_weights(executor)  # /ready's llama_weights
        assert shown == f"{twin.name}: the exact float16 copy of {exact_bf16.name}"
    finally:
        executor.close()
    off = replace(config, f16_twin="off")
    assert ggml_executor_args(off, files)[1]["weights_path"] == exact_bf16


def test_a_failure_keeps_the_file_and_is_tried_again_next_start(exact_bf16, monkeypatch):
    def full_disk(*args):
        raise OSError(28, "No space left on device")

    write_twin = f16_twin.write_twin
    monkeypatch.setattr(f16_twin, "write_twin", full_disk)
    choice = f16_twin.choose_weights(exact_bf16, 4, 1, True)
    assert choice.weights == exact_bf16 and "No space left on device" in choice.why
    f16_twin._chosen.clear()  # next start: the failure was not cached
    monkeypatch.setattr(f16_twin, "write_twin", write_twin)
    monkeypatch.setattr(f16_twin, "time_files", lambda *a, **k: _timed(80.0, 45.0))
    assert f16_twin.choose_weights(exact_bf16, 4, 1, True).weights == f16_twin.twin_path(exact_bf16)
