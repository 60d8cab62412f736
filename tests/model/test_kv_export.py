"""KV export/import through the executors (kvcache/): the next token's logits after an import
equal those after computing the same tokens, into another slot, a fresh executor (a restart)
and a context of another slot count (ggml's header re-wrap); a payload of another KV type is
refused without a crash and leaves the slot usable."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from ultrafast.config import DEMO_MODEL_DIR  # noqa: E402
from ultrafast.core.types import ScheduledSeq, StepPlan  # noqa: E402
from ultrafast.executors.ggml_exec import GgmlExecutor  # noqa: E402
from ultrafast.request import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
DEMO_GGUF = DEMO_MODEL_DIR / "demo-code-f16.gguf"
PROMPT = [(i * 37 + 11) % 390 + 3 for i in range(45)]


def _logits(ex, slot, tokens, start) -> np.ndarray:
    seq = ScheduledSeq("r", slot, list(tokens), start, 1, GREEDY, 7, 0)
    result = ex.execute(StepPlan(seqs=[seq]))
    assert not result.errors, result.errors
    row = ex.last_logits[0]
    return np.array(row.numpy() if hasattr(row, "numpy") else row, dtype=np.float32)


def _ggml(num_slots=3, max_model_len=96, **kw) -> GgmlExecutor:
    return GgmlExecutor(DEMO_GGUF, num_slots, max_model_len, n_threads=1, **kw)


@pytest.fixture(scope="module")
def source():
    """Slot 1 holds PROMPT; `reference` = logits of the next token x computed there."""
    ex = _ggml()
    _logits(ex, 1, PROMPT, 0)
    payload = ex.export_slot(1, len(PROMPT))
    reference = _logits(ex, 1, [42], len(PROMPT))
    yield ex, payload, reference
    ex.close()


def test_import_into_another_slot_gives_identical_logits(source):
    ex, payload, reference = source
    ex.import_slot(2, payload, len(PROMPT))
    assert np.array_equal(_logits(ex, 2, [42], len(PROMPT)), reference)


@pytest.mark.parametrize("num_slots,max_model_len,slot", [(1, 96, 0), (4, 160, 3), (2, 64, 1)])
def test_import_into_a_restarted_executor_of_another_shape(source, num_slots, max_model_len, slot):
    _, payload, reference = source
    with _ggml(num_slots, max_model_len) as ex:
        ex.import_slot(slot, payload, len(PROMPT))
        assert np.array_equal(_logits(ex, slot, [42], len(PROMPT)), reference)


def test_import_of_a_prefix_recomputes_only_the_rest(source):
    _, payload, reference = source
    with _ggml() as ex:
        ex.import_slot(0, payload, 30)  # the slot keeps [0, 30) only
        _logits(ex, 0, PROMPT[30:], 30)
        assert np.allclose(_logits(ex, 0, [42], len(PROMPT)), reference, atol=1e-4)
        with pytest.raises(ValueError):
            ex.import_slot(0, payload, len(PROMPT) + 1)  # more than the payload holds


def test_mismatched_payload_is_refused_and_the_slot_stays_usable(source):
    ex0, payload, _ = source
    with _ggml(kv_cache_dtype="f32") as ex:
        assert ex.kv_fingerprint() != ex0.kv_fingerprint()
        with pytest.raises(ValueError, match="refused"):
            ex.import_slot(1, payload, len(PROMPT))
        with pytest.raises(ValueError):
            ex.import_slot(1, payload[: len(payload) // 2], len(PROMPT))
        with pytest.raises(ValueError):
            ex.import_slot(1, b"", 1)
        assert _logits(ex, 1, PROMPT, 0).shape == (ex.vocab_size,)  # recompute works


def test_flash_attention_changes_the_fingerprint(source):
    ex0 = source[0]
    with _ggml(flash_attn=True) as ex:
        assert ex.kv_fingerprint() != ex0.kv_fingerprint()


def test_torch_executor_export_import(tiny_llama_dir):
    import torch

    from ultrafast.executors.torch_exec import TorchExecutor

    ex = TorchExecutor(tiny_llama_dir, num_slots=2, max_model_len=64, device="cpu", compile="off")
    tokens = PROMPT[:20]
    _logits(ex, 0, tokens, 0)
    payload = ex.export_slot(0, len(tokens))
    reference = _logits(ex, 0, [42], len(tokens))
    fresh = TorchExecutor(
        tiny_llama_dir, num_slots=3, max_model_len=32, device="cpu", compile="off"
    )
    assert fresh.kv_fingerprint() == ex.kv_fingerprint()
    fresh.import_slot(2, payload, len(tokens))
    assert torch.equal(
        torch.as_tensor(_logits(fresh, 2, [42], len(tokens))), torch.as_tensor(reference)
    )
    with pytest.raises(ValueError):
        fresh.import_slot(1, payload[:-8], len(tokens))
    with pytest.raises(ValueError):
        fresh.import_slot(1, payload, len(tokens) + 1)


@pytest.mark.real_model
@pytest.mark.parametrize("kv_dtype,flash", [("f16", False), ("q8_0", True)])
def test_smollm2_export_import_is_bit_identical(kv_dtype, flash):
    from tests.model.gguf_files import require_smollm2

    path = require_smollm2()
    kw = dict(n_threads=1, kv_cache_dtype=kv_dtype, flash_attn=flash)
    with GgmlExecutor(path, 2, 128, **kw) as ex, GgmlExecutor(path, 3, 256, **kw) as fresh:
        tokens = PROMPT[:40]
        _logits(ex, 0, tokens, 0)
        payload = ex.export_slot(0, len(tokens))
        reference = _logits(ex, 0, [42], len(tokens))
        assert fresh.kv_fingerprint() == ex.kv_fingerprint()
        fresh.import_slot(2, payload, len(tokens))
        assert np.array_equal(_logits(fresh, 2, [42], len(tokens)), reference)
