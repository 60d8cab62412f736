"""The torch executor on GGUF files: tensors dequantized into our model (model/gguf_weights.py).

An f32 GGUF converted from a tiny random HF checkpoint must give the HF directory's logits
(1e-4): the test that catches a wrong q/k permutation, a misplaced norm or a lost rope factor.
A q8_0 GGUF dequantized must give llama.cpp's logits on the same file, closer than the
unquantized weights do. Architectures our model lacks are refused with a message naming them.
"""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from tests.model.gguf_files import llama_cpp_requantize, write_vocab_gguf
from ultrafast.core.types import ScheduledSeq, StepPlan
from ultrafast.executors.torch_exec import TorchExecutor
from ultrafast.model.config import ModelLoadError
from ultrafast.model.gguf_meta import read_gguf_metadata
from ultrafast.model.gguf_names import from_interleaved_rope, to_interleaved_rope
from ultrafast.model.gguf_weights import gguf_model_config, load_gguf_model
from ultrafast.model.loader import load_model, read_config
from ultrafast.request import SamplingParams

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [(i * 37 + 11) % 390 + 3 for i in range(48)]  # long enough for llama3's bands
KINDS = ("llama", "llama_tied", "llama3_rope", "qwen2", "qwen3")


def prompt_logits(executor, tokens: list[int] = PROMPT) -> torch.Tensor:
    """Logits of every prompt position from one prefill (float32, [len(tokens), vocab])."""
    seq = ScheduledSeq("p", 0, tokens, 0, len(tokens), GREEDY, 0, 0)
    result = executor.execute(StepPlan([seq]))
    assert not result.errors, result.errors
    logits = executor.last_logits
    if not isinstance(logits, torch.Tensor):  # the ggml executor's rows are a numpy view
        logits = torch.from_numpy(np.array(logits, copy=True))
    return logits.float().reshape(len(tokens), -1)


def test_unpermute_inverts_the_converters_permutation():
    weight = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of dim 8
    permuted = to_interleaved_rope(weight, 4)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(from_interleaved_rope(permuted, 4), weight)


@pytest.mark.parametrize("kind", KINDS)
def test_f32_gguf_gives_the_hf_directory_logits(kind, make_tiny_hf_dir, make_tiny_gguf):
    hf_dir, path = make_tiny_hf_dir(kind), make_tiny_gguf(kind, "f32")
    config = gguf_model_config(read_gguf_metadata(path))
    hf_config = read_config(hf_dir)
    for field in (
        "architecture",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "attention_bias",
        "o_proj_bias",
        "qk_norm",
        "max_position_embeddings",
    ):
        assert getattr(config, field) == getattr(hf_config, field), field
    assert (config.rope_freq_factors is not None) == (kind == "llama3_rope")
    ours = prompt_logits(TorchExecutor(path, num_slots=1, max_model_len=128, device="cpu"))
    ref = prompt_logits(TorchExecutor(hf_dir, num_slots=1, max_model_len=128, device="cpu"))
    assert ref.std() > 0.5  # logits with spread: a wrong layout cannot hide in the tolerance
    assert (ours - ref).abs().max().item() < 1e-4


def test_tied_gguf_shares_one_embedding_tensor(make_tiny_gguf):
    model, config = load_gguf_model(make_tiny_gguf("llama_tied", "f32"))
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_load_model_takes_a_gguf_and_the_dtype_option(tiny_llama_gguf_f32):
    model, config = load_model(tiny_llama_gguf_f32, dtype="bfloat16")
    assert config.architecture == "LlamaForCausalLM"
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    default, _ = load_model(tiny_llama_gguf_f32)  # float32 on the CPU, whatever the file holds
    assert default.lm_head.weight.dtype == torch.float32


def test_q8_0_dequantized_matches_llama_cpp_on_the_same_file(make_tiny_hf_dir, make_tiny_gguf):
    """llama.cpp's q8_0 matmuls also round the activations to 8 bits, so the logits agree
    within that noise, not float32's; and closer than the unquantized weights' logits do."""
    from ultrafast.executors.ggml_exec import GgmlExecutor

    path = make_tiny_gguf("llama", "q8_0")
    meta = read_gguf_metadata(path)
    assert any(t.ggml_type == gguf.GGMLQuantizationType.Q8_0 for t in meta.tensors)
    ours = prompt_logits(TorchExecutor(path, num_slots=1, max_model_len=128, device="cpu"))
    with GgmlExecutor(path, num_slots=1, max_model_len=128, kv_cache_dtype="f32") as ggml:
        theirs = prompt_logits(ggml)
    exact = prompt_logits(
        TorchExecutor(make_tiny_hf_dir("llama"), num_slots=1, max_model_len=128, device="cpu")
    )
    ours_gap = (ours - theirs).abs().mean().item()
    weights_gap = (exact - theirs).abs().mean().item()
    print(f"q8_0 mean |logit diff| vs llama.cpp: dequantized {ours_gap:.4f}, f32 {weights_gap:.4f}")
    assert ours_gap < 0.05 * theirs.std().item()
    assert ours_gap < weights_gap  # the dequantized values, not the originals, are served


@pytest.mark.parametrize("qtype", ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_K_M"])
def test_dequantizing_equals_llama_cpp_own(qtype, make_tiny_gguf, tmp_path):
    """Every tensor equals, bit for bit, what llama.cpp makes of it when it writes the file
    out as F32. Types the converter cannot write come from llama.cpp's quantizer."""
    ftypes = {"q4_0": 2, "q4_1": 3, "q4_K_M": 15}  # llama_ftype values
    if qtype in ftypes:
        src = llama_cpp_requantize(
            make_tiny_gguf("llama", "f32"), tmp_path / "q.gguf", ftypes[qtype]
        )
    else:
        src = make_tiny_gguf("llama", qtype)
    types = {gguf.GGMLQuantizationType(t.ggml_type).name for t in read_gguf_metadata(src).tensors}
    assert types - {"F32"}, types  # something was actually quantized
    ours, _ = load_gguf_model(src)
    theirs, _ = load_gguf_model(llama_cpp_requantize(src, tmp_path / "f32.gguf"))
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), name


def ultrafast_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_other_architectures_are_refused_with_a_pointer_to_ggml(tmp_path):
    path = write_vocab_gguf(tmp_path / "phi2.gguf", arch="phi2")
    with pytest.raises(ModelLoadError, match=r"'phi2'.*--executor ggml"):
        load_gguf_model(path)
    moe = write_vocab_gguf(tmp_path / "moe.gguf", extra={"llama.expert_count": 8})
    with pytest.raises(ModelLoadError, match=r"mixture of 8 experts.*--executor ggml"):
        load_gguf_model(moe)
    done = ultrafast_cli("generate", "hi", "--model", str(path), "--executor", "torch")
    assert done.returncode == 2, done.stderr
    assert "'phi2'" in done.stderr and "--executor ggml" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("arch", ["gpt2", "starcoder2"])
def test_real_foreign_architectures_are_refused(arch, tmp_path):
    """Random-weight GGUFs the ggml executor serves (tests/model/arch_ggufs.py); declared as
    llama, their tensors still give them away."""
    from tests.model.arch_ggufs import write_arch_gguf

    path = write_arch_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(ModelLoadError, match=rf"'{arch}'.*--executor ggml"):
        load_gguf_model(path)
    disguised = write_arch_gguf(tmp_path / "disguised.gguf", arch, declare_as="llama")
    with pytest.raises(ModelLoadError, match=r"--executor ggml"):
        load_gguf_model(disguised)


def test_cli_generates_from_a_gguf_on_the_torch_executor(make_tiny_gguf):
    """Greedy text from the f32 file: torch (dequantized) and ggml tell the same story."""
    path = str(make_tiny_gguf("llama", "f32"))
    texts = {}
    for kind in ("torch", "ggml"):
        done = ultrafast_cli(
            "generate", "Hello world", "--model", path, "--executor", kind, "--max-tokens", "12"
        )
        assert done.returncode == 0, done.stderr
        texts[kind] = done.stdout
    assert texts["torch"].strip() and texts["torch"] == texts["ggml"]
