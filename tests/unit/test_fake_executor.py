"""The load-test executor: its output is exactly `reference_tokens`, batched or alone, with
chunked prefill and preemption, and its fault hook fails only the marked request."""

import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.executors.fake_exec import (
    FAULT_FATAL,
    FAULT_REQUEST,
    FAULT_STEP,
    FakeExecutor,
    FatalFault,
    fault_prompt,
    reference_tokens,
)
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.tokenizer import Tokenizer

TOKENIZER_JSON = DEMO_MODEL_DIR / "tokenizer.json"


def engine(num_slots=2, chunk=4):
    executor = FakeExecutor.for_tokenizer(
        TOKENIZER_JSON, num_slots=num_slots, max_model_len=128, step_s=0
    )
    config = SchedulerConfig(
        max_num_seqs=num_slots, max_prefill_chunk_tokens=chunk, max_model_len=128
    )
    return EngineCore(executor, config), executor


def run(core, requests):
    out = {r.request_id: [] for r in requests}
    errors = {}
    for r in requests:
        core.add_request(r)
    while core.has_work():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.error:
                errors[o.request_id] = o.error
    return out, errors


def req(rid, prompt, n, tier=ServiceTier.DEFAULT):
    return Request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True), tier=tier)


def test_batched_chunked_and_preempted_output_is_the_reference():
    core, executor = engine(num_slots=2, chunk=3)
    prompts = {f"r{i}": [20 + i, 30, 40 + i, 50, 60, 70 + i] for i in range(5)}
    requests = [req(rid, p, 12) for rid, p in prompts.items()]
    requests.append(req("hi", [99, 98, 97], 5, ServiceTier.PRIORITY))  # preempts a default one
    out, errors = run(core, requests)
    assert not errors
    for r in requests:
        assert out[r.request_id] == reference_tokens(
            r.prompt_token_ids, r.sampling_params.max_tokens, executor.output_ids
        )


def test_tokens_are_plain_words_that_decode_by_concatenation():
    _, executor = engine()
    tok = Tokenizer.from_dir(DEMO_MODEL_DIR)
    ids = reference_tokens([5, 6, 7], 40, executor.output_ids)
    assert not set(ids) & set(tok.eos_token_ids)
    assert tok.decode(ids) == "".join(tok.decode([i]) for i in ids)
    assert len(set(ids)) > 10  # not a constant stream: a lost token would show


def test_request_fault_fails_only_the_marked_request_at_its_index():
    core, executor = engine(num_slots=3)
    bad = req("bad", fault_prompt(FAULT_REQUEST, 3, [40, 41]), 10)
    good = req("good", [40, 41, 42], 10)
    out, errors = run(core, [bad, good])
    assert set(errors) == {"bad"}
    assert out["bad"] == reference_tokens(bad.prompt_token_ids, 3, executor.output_ids)
    assert out["good"] == reference_tokens(good.prompt_token_ids, 10, executor.output_ids)


def test_step_fault_fails_the_step_and_fatal_fault_escapes_the_engine():
    core, _ = engine(num_slots=2)
    out, errors = run(core, [req("s", fault_prompt(FAULT_STEP, 0, [7]), 5)])
    assert "s" in errors and out["s"] == []
    core.add_request(req("f", fault_prompt(FAULT_FATAL, 1, [7]), 5))
    with pytest.raises(FatalFault):
        while core.has_work():
            core.step()
