"""Compiled decode (torch.compile at padded static shapes) agrees with the eager executor.

The tiny model keeps the inductor compiles (batch 1, then batch/keys dynamic) well under a
minute on two cores; the static-shape twin without compile also runs a sliding-window model.
"""

import pytest

from tests.decode_twin import run_twin
from ultrafast.executors.torch_compiled import resolve_mode
from ultrafast.executors.torch_exec import TorchExecutor
from ultrafast.model.loader import build_dummy_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _pair(config: dict, mode: str):
    model = build_dummy_model(config, dtype="float32", seed=5, std=0.2)  # wide: no argmax ties
    fast = TorchExecutor(model, num_slots=4, max_model_len=64, device="cpu", compile=mode)
    slow = TorchExecutor(model, num_slots=4, max_model_len=64, device="cpu", compile=False)
    assert fast.decode is not None and slow.decode is None
    fast.decode.key_lens = [16, 32, 48]  # several key buckets inside a short test
    return fast, slow


@pytest.mark.compile
def test_inductor_decode_matches_eager():
    fast, slow = _pair(CONFIG, "inductor")
    num_decode_steps = run_twin(fast, slow, atol=1e-4)
    assert fast.decode.disabled_reason is None
    assert fast.decode.num_steps == num_decode_steps > 0


def test_static_shape_twin_with_sliding_window():
    config = {**CONFIG, "architectures": ["MistralForCausalLM"], "sliding_window": 5}
    fast, slow = _pair(config, "graphs")
    num_decode_steps = run_twin(fast, slow, atol=1e-5, seed=1)
    assert fast.decode.disabled_reason is None
    assert fast.decode.num_steps == num_decode_steps


def test_buckets_and_modes():
    model = build_dummy_model(CONFIG, dtype="float32")
    ex = TorchExecutor(model, num_slots=6, max_model_len=1000, device="cpu", compile="graphs")
    assert ex.decode.batch_sizes == [1, 2, 4, 6]
    assert ex.decode.key_lens == [128, 256, 512, 1000]
    assert ex.decode.bucket(3, 129) == (4, 256) and ex.decode.bucket(6, 1000) == (6, 1000)
    assert ex.kv.num_slots == 7  # one scratch slot for the padding rows
    before = ex.kv.k[0][:6].clone()
    assert ex.decode.capture([1, 3], [100]) == 2 and ex.decode.num_steps == 0
    assert ex.kv.k[0][:6].equal(before)  # ahead-of-time shapes touch only the scratch slot
    assert TorchExecutor(model, 2, 16, device="cpu").decode is None  # auto: off on CPU
    assert resolve_mode(None, ex.device) == "off" and resolve_mode(True, ex.device) == "inductor"
    with pytest.raises(ValueError, match="compile must be"):
        resolve_mode("fast", ex.device)
