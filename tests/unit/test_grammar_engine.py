"""Constrained decoding through the engine loop, on the fake executor over the demo
vocabulary: the fake draws among the tokens the mask allows, so every step's mask matters."""

import json

import jsonschema
import pytest

from tests.unit.engine_driver import run_all
from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.engine.speculation import SpeculationConfig, Speculator
from ultrafast.executors.fake_exec import FakeExecutor, plain_word_tokens
from ultrafast.grammar import GrammarSpec
from ultrafast.grammar.matcher import GrammarRuntime
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "level": {"enum": ["debug", "info", "warn"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["level", "count", "ok"],
    "additionalProperties": False,
}
SPEC = GrammarSpec.from_json_schema(SCHEMA, strict=True)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def runtime(tok):
    return GrammarRuntime.for_tokenizer(tok, tok.vocab_size)


def engine(tok, runtime, num_slots=4, speculator=None, keeps_logits=True):
    tokenizer_json = DEMO_MODEL_DIR / "tokenizer.json"
    executor = FakeExecutor(
        num_slots, 512, tok.vocab_size, plain_word_tokens(tokenizer_json), keep_plans=True
    )
    executor.keeps_logits = keeps_logits  # False: an executor without KeptSampling
    config = SchedulerConfig(max_num_seqs=num_slots, max_model_len=512)
    return EngineCore(executor, config, speculator=speculator, grammar=runtime), executor


def request(tok, rid, grammar=SPEC, tier=ServiceTier.DEFAULT, max_tokens=200, prompt="x"):
    ids = tok.encode(f"{prompt} {rid}", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, grammar=grammar)
    return Request(rid, ids, params, tier=tier, eos_token_ids=tok.eos_token_ids)


def text(tok, ids):
    return tok.decode(ids)


def test_constrained_and_free_requests_share_steps(tok, runtime):
    core, executor = engine(tok, runtime)
    reqs = [request(tok, f"c{i}") for i in range(3)] + [request(tok, "free", None, max_tokens=20)]
    out, finish = run_all(core, reqs)
    for i in range(3):
        jsonschema.validate(json.loads(text(tok, out[f"c{i}"])), SCHEMA)
        assert finish[f"c{i}"] == "stop"  # the grammar completed, EOS was the only choice
        assert out[f"c{i}"][-1] in tok.eos_token_ids
    assert finish["free"] == "length" and len(out["free"]) == 20
    mixed = [p for p in executor.plans if {s.token_mask is None for s in p.seqs} == {True, False}]
    assert mixed, "a step with a constrained and a free request"
    # tokens the grammar forces rode as drafts: fewer steps than output tokens
    assert sum(1 for p in executor.plans if any(s.num_logits > 1 for s in p.seqs))


def test_speculation_and_preemption_change_nothing(tok, runtime):
    alone, _ = engine(tok, runtime)
    want, _ = run_all(alone, [request(tok, f"d{i}") for i in range(2)])
    # 2 slots, a priority arrival preempts a constrained request mid-object; n-gram and a
    # client prediction (half right) propose drafts the grammar cuts or the target rejects
    speculator = Speculator(
        SpeculationConfig(method="ngram", tiers=tuple(ServiceTier), use_measured_costs=False)
    )
    core, executor = engine(tok, runtime, num_slots=2, speculator=speculator)
    reqs = [request(tok, f"d{i}") for i in range(2)]
    reqs[0].prediction_token_ids = want["d0"][:6] + tok.encode(
        '"info" 7}', add_special_tokens=False
    )
    reqs.append(request(tok, "p", tier=ServiceTier.PRIORITY))
    got, finish = run_all(core, reqs, arrivals=[0, 0, 3])
    assert core.scheduler.num_preemptions >= 1
    assert got["d0"] == want["d0"] and got["d1"] == want["d1"]
    jsonschema.validate(json.loads(text(tok, got["p"])), SCHEMA)
    assert set(finish.values()) == {"stop"}


def test_a_grammar_is_refused_without_a_runtime(tok):
    executor = FakeExecutor(2, 128, tok.vocab_size)
    core = EngineCore(executor, SchedulerConfig(max_num_seqs=2, max_model_len=128))
    with pytest.raises(ValueError, match="not available"):
        core.add_request(request(tok, "a"))


def test_a_grammar_that_does_not_compile_fails_only_its_request(tok, runtime):
    core, _ = engine(tok, runtime)
    bad = GrammarSpec.from_json_schema({"type": "string", "format": "nope"})
    with pytest.raises(ValueError):
        core.add_request(request(tok, "bad", bad))
    out, finish = run_all(core, [request(tok, "good")])
    assert finish["good"] == "stop"
