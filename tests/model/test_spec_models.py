"""Speculative decoding on real executors: the output is the plain output, token for token.

Both executors, every draft source (n-gram lookup, the client's prediction, a draft model),
several requests drafting in one step, max_tokens and EOS landing inside accepted drafts. The
demo model + demo draft give realistic acceptance; tiny random models check the wiring with a
draft model that is mostly wrong, and seeded sampling with deterministic drafts.
"""

from __future__ import annotations

import pytest

from tests.model.conftest import build_tiny_hf_dir
from ultrafast.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR, EngineConfig
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.engine.draft_model import DraftModelProposer
from ultrafast.engine.speculation import SpeculationConfig, Speculator
from ultrafast.llm import build_engine
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.tokenizer import Tokenizer

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    if i %",
]
KINDS = ("ggml", "torch")
PRIORITY = ServiceTier.PRIORITY


def greedy(max_tokens=40, ignore_eos=True):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def generate(engine, prompt_ids, params, predictions=None, eos=()):
    requests = [
        Request(
            f"r{i}-{id(params)}",
            list(ids),
            params,
            tier=PRIORITY,
            eos_token_ids=eos,
            prediction_token_ids=list(predictions[i]) if predictions else [],
        )
        for i, ids in enumerate(prompt_ids)
    ]
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    engine.pool.reset_cache()
    return [r.output_token_ids for r in requests]


@pytest.fixture(scope="module")
def prompt_ids():
    tok = Tokenizer.from_dir(DEMO_MODEL_DIR)
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module", params=KINDS)
def demo_engines(request, one_cpu_thread):
    """{method: engine} for one executor kind, all on the demo model (+ the demo draft)."""
    engines = {}
    for method in ("off", "ngram", "draft"):
        config = EngineConfig(
            model=str(DEMO_MODEL_DIR),
            executor=request.param,
            speculation=method,
            num_slots=4,
            max_num_seqs=4,
            max_model_len=256,
            max_num_batched_tokens=64,
            max_prefill_chunk_tokens=32,
            device="cpu",
            dtype="float32",
        )
        engines[method] = build_engine(config)[0]
    yield request.param, engines
    for engine in engines.values():
        engine.executor.close()
        engine.speculator.close()


@pytest.fixture(scope="module")
def plain(demo_engines, prompt_ids):
    return generate(demo_engines[1]["off"], prompt_ids, greedy())


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_concurrent_greedy_spec_equals_plain(demo_engines, prompt_ids, plain, method):
    engine = demo_engines[1][method]
    before = sum(engine.speculation_stats.num_accepted_tokens.values())
    assert generate(engine, prompt_ids, greedy()) == plain
    assert (
        sum(engine.speculation_stats.num_accepted_tokens.values()) > before
    )  # drafts were accepted


def test_prediction_drafts_equal_plain_and_are_counted(demo_engines, prompt_ids, plain):
    engine = demo_engines[1]["off"]  # speculation off: a client prediction is still used
    edited = [p[:10] + [7, 8, 9] + p[13:] for p in plain]  # the prediction is mostly right
    requests = [
        Request(
            f"pred-{i}", list(ids), greedy(), tier=ServiceTier.FLEX, prediction_token_ids=edited[i]
        )
        for i, ids in enumerate(prompt_ids)
    ]
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    engine.pool.reset_cache()
    assert [r.output_token_ids for r in requests] == plain
    assert all(r.num_accepted_prediction_tokens >= 15 for r in requests)
    assert all(r.num_rejected_prediction_tokens >= 1 for r in requests)


def test_max_tokens_cut_mid_draft(demo_engines, prompt_ids, plain):
    _, engines = demo_engines
    for n in (1, 2, 3, 5, 9):
        predictions = [p[:20] for p in plain]  # long accepted drafts
        assert generate(engines["off"], prompt_ids[:2], greedy(n), predictions) == [
            p[:n] for p in plain[:2]
        ]
        assert generate(engines["draft"], prompt_ids[:2], greedy(n)) == [p[:n] for p in plain[:2]]


def test_eos_inside_accepted_drafts(demo_engines, prompt_ids, plain):
    _, engines = demo_engines
    eos = plain[0][12]
    cut = plain[0].index(eos) + 1
    out = generate(engines["off"], prompt_ids[:1], greedy(ignore_eos=False), [plain[0]], eos=(eos,))
    assert out == [plain[0][:cut]]
    out = generate(engines["ngram"], prompt_ids[:1], greedy(ignore_eos=False), eos=(eos,))
    assert out == [plain[0][:cut]]


def test_seeded_sampling_with_deterministic_drafts_equals_plain(demo_engines, prompt_ids):
    _, engines = demo_engines
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=11, ignore_eos=True)
    expected = generate(engines["off"], prompt_ids, params)
    assert generate(engines["ngram"], prompt_ids, params) == expected
    assert generate(engines["off"], prompt_ids, params, predictions=expected) == expected


def test_sampling_with_the_draft_model_runs_and_accepts(demo_engines, prompt_ids):
    engine = demo_engines[1]["draft"]
    params = SamplingParams(temperature=0.7, max_tokens=30, seed=3, ignore_eos=True)
    before = dict(engine.speculation_stats.num_accepted_tokens)
    outs = generate(engine, prompt_ids, params)
    assert all(len(o) == 30 for o in outs)
    assert engine.speculation_stats.num_accepted_tokens["draft"] > before.get("draft", 0)
    assert generate(engine, prompt_ids, params) == outs  # seeded: reproducible


# ---- tiny random models: a draft model that is mostly wrong -------------------------------


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    return build_tiny_hf_dir(tmp_path_factory.mktemp("hf_draft"), "llama", seed=1)


def _tiny_executor(kind, hf_dir, make_gguf_path):
    if kind == "ggml":
        from ultrafast.executors.ggml_exec import GgmlExecutor

        return GgmlExecutor(
            make_gguf_path, num_slots=3, max_model_len=128, n_threads=1, kv_cache_dtype="f32"
        )
    from ultrafast.executors.torch_exec import TorchExecutor

    return TorchExecutor(hf_dir, num_slots=3, max_model_len=128, device="cpu", dtype="float32")


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_models_with_a_bad_draft_model(
    kind, tiny_llama_dir, tiny_llama_gguf_f32, tiny_draft_dir, tmp_path, one_cpu_thread
):
    from ultrafast.convert import convert_hf_to_gguf

    draft_gguf = (
        convert_hf_to_gguf(tiny_draft_dir, tmp_path / "draft.gguf", "f32")
        if kind == "ggml"
        else None
    )
    config = SchedulerConfig(
        max_num_seqs=3, max_model_len=128, max_num_batched_tokens=32, max_prefill_chunk_tokens=16
    )
    prompts = [[0, 5, 17, 40, 33], [0, 99, 12] * 6, [0, 250, 251, 252, 253, 7, 9]]
    params = greedy(20)
    target = _tiny_executor(kind, tiny_llama_dir, tiny_llama_gguf_f32)
    draft = _tiny_executor(kind, tiny_draft_dir, draft_gguf)
    try:
        plain = generate(EngineCore(target, config), prompts, params)
        for method in ("draft", "ngram"):
            speculator = Speculator(SpeculationConfig(method=method), DraftModelProposer(draft))
            engine = EngineCore(target, config, speculator=speculator)
            assert generate(engine, prompts, params) == plain
        edited = [p[:4] + [(p[4] + 1) % 300] + p[5:] for p in plain]  # client predictions
        assert generate(engine, prompts, params, edited) == plain
        assert speculator.stats.num_accepted_tokens["prediction"] > 0
        assert (
            speculator.stats.num_draft_tokens["prediction"]
            > speculator.stats.num_accepted_tokens["prediction"]
        )
    finally:
        target.close()
        draft.close()


def test_draft_model_must_share_the_tokenizer(tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir),
        executor="torch",
        speculation="draft",
        draft_model=str(DEMO_DRAFT_DIR),
        device="cpu",
    )
    with pytest.raises(ValueError, match="tokenizer"):
        build_engine(config)
    config = EngineConfig(
        model=str(tiny_llama_dir), executor="torch", speculation="draft", device="cpu"
    )
    with pytest.raises(ValueError, match="draft-model"):
        build_engine(config)
