"""On CUDA: decode steps replayed from CUDA graphs (eager kernels, and inductor-compiled) give
the eager executor's greedy tokens and logits. Skipped without CUDA."""

import pytest
import torch

from tests.decode_twin import run_twin
from ultrafast.executors.torch_exec import TorchExecutor
from ultrafast.model.loader import build_dummy_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize("mode", ["graphs", "inductor"])
def test_cuda_graph_decode_matches_eager(mode):
    model = build_dummy_model(CONFIG, dtype="float32", device="cuda", seed=7, std=0.2)
    fast = TorchExecutor(model, num_slots=4, max_model_len=64, device="cuda", compile=mode)
    slow = TorchExecutor(model, num_slots=4, max_model_len=64, device="cuda", compile=False)
    fast.decode.key_lens = [16, 32, 64]
    num_decode_steps = run_twin(fast, slow, atol=2e-4)
    assert fast.decode.disabled_reason is None
    assert fast.decode.num_steps == num_decode_steps
    assert len(fast.decode._graphs) >= 4  # several (batch, keys) buckets were captured
    fast.close()
    slow.close()


def test_default_on_cuda_is_compiled():
    model = build_dummy_model(CONFIG, dtype="bfloat16", device="cuda")
    ex = TorchExecutor(model, num_slots=2, max_model_len=32, device="cuda")
    import importlib.util

    expected = "inductor" if importlib.util.find_spec("triton") else "graphs"
    assert ex.decode is not None and ex.decode.mode == expected
    ex.close()
