"""The bundled demo model: ggml == torch greedy tokens, batch invariance, plausible Python."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ultrafast.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from ultrafast.convert import convert_hf_to_gguf
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.executors.ggml_exec import GgmlExecutor
from ultrafast.executors.torch_exec import TorchExecutor
from ultrafast.request import Request, SamplingParams
from ultrafast.tokenizer import Tokenizer

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    if i %",
    "    return self._",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    return convert_hf_to_gguf(
        DEMO_MODEL_DIR, tmp_path_factory.mktemp("gguf") / "demo-f32.gguf", outtype="f32"
    )


def run(executor, prompt_ids: list[list[int]], together: bool) -> list[list[int]]:
    engine = EngineCore(
        executor,
        SchedulerConfig(
            max_num_seqs=executor.num_slots,
            max_model_len=executor.max_model_len,
            max_num_batched_tokens=64,
            max_prefill_chunk_tokens=16,
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [Request(f"r{i}", ids, params) for i, ids in enumerate(prompt_ids)]
    groups = [requests] if together else [[r] for r in requests]
    for group in groups:
        for r in group:
            engine.add_request(r)
        while engine.has_work():
            engine.step()
        engine.pool.reset_cache()
    return [r.output_token_ids for r in requests]


def test_ggml_and_torch_agree_and_batching_changes_nothing(tokenizer, f32_gguf):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    torch_ex = TorchExecutor(
        DEMO_MODEL_DIR, num_slots=len(ids), max_model_len=256, device="cpu", dtype="float32"
    )
    ggml_ex = GgmlExecutor(f32_gguf, num_slots=len(ids), max_model_len=256, kv_cache_dtype="f32")
    try:
        torch_alone = run(torch_ex, ids, together=False)
        ggml_alone = run(ggml_ex, ids, together=False)
        assert ggml_alone == torch_alone
        assert run(torch_ex, ids, together=True) == torch_alone
        assert run(ggml_ex, ids, together=True) == ggml_alone
    finally:
        ggml_ex.close()


def test_shipped_files_are_complete():
    for model_dir in (DEMO_MODEL_DIR, DEMO_DRAFT_DIR):
        names = {p.name for p in model_dir.iterdir()}
        assert {
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        } <= names
        assert any(n.endswith(".gguf") for n in names), f"{model_dir} has no GGUF copy"
    assert (
        Tokenizer.from_dir(DEMO_DRAFT_DIR).vocab_size
        == Tokenizer.from_dir(DEMO_MODEL_DIR).vocab_size
    )


def test_generate_cli_writes_python_looking_code():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ultrafast.cli",
            "generate",
            "def fibonacci(n):",
            "--max-tokens",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout
    body = text[len("def fibonacci(n):") :]
    assert text.startswith("def fibonacci(n):") and len(body.strip()) > 20
    assert "\n    " in body  # an indented block follows the def
    assert any(word in body for word in ("return", "if ", "for ", "=", "self", "(")), body


def test_offline_llm_generate_batch_stop_and_order():
    from ultrafast.llm import LLM

    llm = LLM(executor="ggml", num_slots=4, max_num_seqs=4, max_model_len=256)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16)
        outs = llm.generate(PROMPTS[:3], params)
        assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
        assert all(o.finish_reason in ("length", "stop") and o.text for o in outs)
        alone = llm.generate(PROMPTS[1], params)[0]
        assert alone.text == outs[1].text  # batched == alone, and in prompt order
        stop = outs[0].text[2:4]
        cut = llm.generate(PROMPTS[0], params, stop=[stop])[0]
        assert cut.text == outs[0].text[: outs[0].text.index(stop)] and cut.finish_reason == "stop"
        assert "".join(llm.stream(PROMPTS[0], params)) == outs[0].text
    finally:
        llm.close()
