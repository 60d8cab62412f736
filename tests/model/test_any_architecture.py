"""The ggml executor serves any architecture llama.cpp runs, not only the Llama family our torch
model implements: random-weight gpt2 and starcoder2 GGUFs written here (tests/model/arch_ggufs.py)
generate exactly what llama-cpp-python's own greedy loop generates from the same prompt ids,
through the offline API and `ultrafast generate`; n-gram speculation keeps the greedy tokens;
a file llama.cpp cannot load is a clear error that carries llama.cpp's reason, and a recurrent
model (mamba), which llama.cpp runs, is refused for the KV rollback our slots need.
"""

from __future__ import annotations

import subprocess
import sys

import llama_cpp
import pytest

from tests.model.arch_ggufs import ARCHS, CONTEXT, EMBED, HEADS, KV_HEADS, LAYERS, write_arch_gguf
from ultrafast.llm import LLM
from ultrafast.model.config import ModelLoadError
from ultrafast.model.kv_budget import kv_bytes_per_position
from ultrafast.model_files import load_tokenizer, resolve_model
from ultrafast.request import SamplingParams, ServiceTier

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
NUM_NEW = 24


@pytest.fixture(scope="module")
def arch_gguf(tmp_path_factory):
    cache = {}

    def make(arch: str):
        if arch not in cache:
            cache[arch] = write_arch_gguf(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch)
        return cache[arch]

    return make


def llama_cpp_greedy(path, prompt_ids: list[int], num_new: int) -> tuple[list[int], list[bool]]:
    """llama-cpp-python's own generation loop at temperature 0; also which tokens are EOG."""
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=1, verbose=False)
    try:
        out = []
        for token in llm.generate(prompt_ids, temp=0.0, reset=True):
            out.append(token)
            if len(out) == num_new:
                break
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        return out, [bool(llama_cpp.llama_vocab_is_eog(vocab, t)) for t in out]
    finally:
        llm.close()


def offline(path, speculation: str = "off", num_slots: int = 2, max_model_len: int = 256) -> LLM:
    # drafts sized from fixed costs: measured ones on a busy machine may say none pay
    return LLM(
        str(path),
        speculation=speculation,
        speculation_measured_costs=False,
        n_threads=1,
        num_slots=num_slots,
        max_num_seqs=num_slots,
        max_model_len=max_model_len,
    )


def ultrafast(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_the_executor_takes_its_sizes_from_llama_cpp(arch_gguf, arch):
    llm = offline(arch_gguf(arch), max_model_len=128)
    try:
        executor = llm.engine.executor
        assert executor.architecture == arch
        assert (executor.n_layer, executor.n_embd, executor.n_ctx_train) == (
            LAYERS,
            EMBED,
            CONTEXT,
        )
        assert executor.vocab_size == llm.tokenizer.vocab_size
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_llama_cpp_python_on_the_same_prompt_ids(arch_gguf, arch):
    path = arch_gguf(arch)
    prompt_ids = load_tokenizer(resolve_model(path)).encode(PROMPT)
    expected, _ = llama_cpp_greedy(path, prompt_ids, NUM_NEW)
    assert len(set(expected)) > 3  # a model that says something, not one token over and over
    llm = offline(path)
    try:
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        [out] = llm.generate(prompt_ids, params)
    finally:
        llm.close()
    assert out.token_ids == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_ultrafast_generate_prints_llama_cpps_greedy_text(arch_gguf, arch):
    path = arch_gguf(arch)
    tokenizer = load_tokenizer(resolve_model(path))
    expected, eog = llama_cpp_greedy(path, tokenizer.encode(PROMPT), NUM_NEW)
    if True in eog:  # generation stops at the first end-of-generation token
        expected = expected[: eog.index(True)]
    done = ultrafast(
        "generate",
        "--model",
        str(path),
        PROMPT,
        "--max-tokens",
        str(NUM_NEW),
        "--threads",
        "1",
        "--spec",
        "off",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == PROMPT + tokenizer.decode(expected) + "\n"


def test_ngram_speculation_drafts_and_keeps_the_greedy_tokens(arch_gguf):
    path = arch_gguf("gpt2")  # from this prompt its random weights fall into a loop
    prompt_ids = load_tokenizer(resolve_model(path)).encode("def fibonacci(n):")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected, _ = llama_cpp_greedy(path, prompt_ids, 40)
    llm = offline(path, speculation="ngram")
    try:
        [out] = llm.generate(prompt_ids, params, tier=ServiceTier.PRIORITY)
        stats = llm.engine.speculation_stats
    finally:
        llm.close()
    assert out.token_ids == expected
    assert stats is not None
    assert stats.num_draft_tokens.get("ngram", 0) > 0
    assert stats.num_accepted_tokens.get("ngram", 0) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_budget_reads_the_generic_keys(arch_gguf, arch):
    kv_heads = HEADS if arch == "gpt2" else KV_HEADS  # gpt2 writes no head_count_kv
    head_dim = EMBED // HEADS
    assert kv_bytes_per_position(arch_gguf(arch), None) == LAYERS * kv_heads * 2 * head_dim * 2


def test_a_gguf_llama_cpp_cannot_load_is_a_model_load_error(tmp_path):
    path = write_arch_gguf(tmp_path / "unknown.gguf", "gpt2", declare_as="gpt7")
    with pytest.raises(ModelLoadError, match="unknown model architecture: 'gpt7'"):
        offline(path, num_slots=1, max_model_len=64)
    done = ultrafast("generate", "--model", str(path), "hi", "--spec", "off")
    assert done.returncode == 2
    assert "llama.cpp could not load" in done.stderr and "gpt7" in done.stderr
    assert "Traceback" not in done.stderr


def test_learned_positions_cap_the_context_at_the_trained_length(arch_gguf):
    from ultrafast.executors.ggml_exec import GgmlExecutor

    with pytest.raises(ModelLoadError, match="no RoPE"):
        GgmlExecutor(arch_gguf("gpt2"), num_slots=1, max_model_len=CONTEXT + 1, n_threads=1)
    llm = offline(arch_gguf("gpt2"), num_slots=1, max_model_len=4096)
    try:  # the engine clamps --max-model-len to the declared context, so this serves
        assert llm.engine.executor.max_model_len == CONTEXT
    finally:
        llm.close()


def test_a_recurrent_model_is_refused_for_what_the_slots_need_not_its_name(tmp_path):
    path = write_arch_gguf(tmp_path / "tiny-mamba.gguf", "mamba")
    llm = llama_cpp.Llama(str(path), n_ctx=64, verbose=False)  # llama.cpp itself runs it
    llm.close()
    done = ultrafast("generate", "--model", str(path), "hi", "--spec", "off")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "recurrent state, which cannot be rolled back" in done.stderr


def test_kv_budget_sums_per_layer_head_counts(tmp_path):
    """Hybrid models write head_count_kv per layer, 0 on layers without attention."""
    import gguf

    path = tmp_path / "hybrid.gguf"
    writer = gguf.GGUFWriter(str(path), "somehybrid")
    writer.add_block_count(4)
    writer.add_embedding_length(EMBED)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv([0, KV_HEADS, 0, KV_HEADS])
    writer.add_key_length(32)
    writer.add_value_length(16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert kv_bytes_per_position(path, None) == 2 * KV_HEADS * (32 + 16) * 2
