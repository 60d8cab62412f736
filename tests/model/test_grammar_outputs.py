"""Every output under a JSON schema validates (tests/data/grammar_schemas.json: 50 schemas,
each value bounded in size so every run ends within max_tokens), with greedy and sampled
decoding; and with speculation on, greedy output is token-identical to speculation off."""

import json
from pathlib import Path

import jsonschema
import pytest

from tests.model.gguf_files import require_smollm2
from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.grammar import GrammarSpec
from ultrafast.llm import LLM
from ultrafast.request import Request, SamplingParams

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "grammar_schemas.json").read_text())
MAX_TOKENS = 256


def run(llm, schemas, temperatures, prompt="Answer in JSON:\n"):
    """(name, temperature) -> (output ids, finish reason), all requests batched."""
    tok = llm.tokenizer
    ids = tok.encode(prompt)
    requests = {}
    for temperature in temperatures:
        for i, entry in enumerate(schemas):
            params = SamplingParams(
                max_tokens=MAX_TOKENS,
                temperature=temperature,
                seed=i,
                grammar=GrammarSpec.from_json_schema(entry["schema"], strict=True),
            )
            rid = f"{entry['name']}@{temperature}"
            requests[rid] = Request(rid, ids, params, eos_token_ids=tok.eos_token_ids)
            llm.engine.add_request(requests[rid])
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    finish: dict[str, str | None] = {}
    while llm.engine.has_work():
        for o in llm.engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finish[o.request_id] = o.finish_reason
    return {rid: (out[rid], finish[rid]) for rid in requests}


def assert_all_valid(llm, schemas, results):
    by_name = {e["name"]: e["schema"] for e in schemas}
    for rid, (ids, reason) in results.items():
        text = llm.tokenizer.decode(ids)
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), by_name[rid.split("@")[0]])


def demo(speculation):
    n = len(SCHEMAS)
    return LLM(
        str(DEMO_MODEL_DIR),
        speculation=speculation,
        num_slots=n,
        max_num_seqs=n,
        speculation_tiers=("priority", "default", "flex"),
    )


def test_50_schemas_greedy_and_sampled_and_speculation_is_exact():
    llm = demo("off")
    try:
        plain = run(llm, SCHEMAS, (0.0, 1.0))
    finally:
        llm.close()
    assert_all_valid(llm, SCHEMAS, plain)
    llm = demo("auto")  # n-gram and draft-model drafts, plus the grammar's forced tokens
    try:
        outputs = run(llm, SCHEMAS, (0.0,))
        drafted = llm.engine.speculation_stats.num_draft_tokens
    finally:
        llm.close()
    for rid, got in outputs.items():
        assert got == plain[rid], rid
    assert drafted.get("grammar", 0) > 0 and sum(drafted.values()) > drafted["grammar"]


@pytest.mark.real_model
def test_smollm2_subset_validates():
    schemas = SCHEMAS[::5]
    llm = LLM(str(require_smollm2()), speculation="off", num_slots=10, max_num_seqs=10)
    try:
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Reply with a JSON object."}]
        )
        results = run(llm, schemas, (0.0, 0.8), prompt)
    finally:
        llm.close()
    assert_all_valid(llm, schemas, results)


def test_torch_executor_masks_too():
    schemas = SCHEMAS[::10]
    llm = LLM(str(DEMO_MODEL_DIR), executor="torch", speculation="off", num_slots=5, max_num_seqs=5)
    try:
        results = run(llm, schemas, (0.0, 1.0))
    finally:
        llm.close()
    assert_all_valid(llm, schemas, results)


@pytest.mark.parametrize("executor", ["ggml", "torch"])
def test_a_grammar_that_compiles_during_the_prefill_gives_the_same_tokens(executor):
    """The prompt prefills while the grammar compiles and its last row's logits are kept
    (ScheduledSeq.defer_sample): greedy and seeded sampled outputs equal those of grammars
    compiled up front, on both real executors."""
    from concurrent.futures import Future

    schemas = SCHEMAS[::10]
    n = 2 * len(schemas)
    llm = LLM(
        str(DEMO_MODEL_DIR), executor=executor, speculation="off", num_slots=n, max_num_seqs=n
    )
    try:
        want = run(llm, schemas, (0.0, 1.0))
        tok, engine = llm.tokenizer, llm.engine
        ids = tok.encode("Answer in JSON:\n")
        pending: Future = Future()
        requests = {}
        for temperature in (0.0, 1.0):
            for i, entry in enumerate(schemas):
                spec = GrammarSpec.from_json_schema(entry["schema"], strict=True)
                params = SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=temperature, seed=i, grammar=spec
                )
                rid = f"{entry['name']}@{temperature}"
                request = Request(rid, ids, params, eos_token_ids=tok.eos_token_ids)
                request.grammar_pending = pending
                requests[rid] = request
                engine.add_request(request)
        out: dict[str, list[int]] = {rid: [] for rid in requests}
        finish: dict[str, str | None] = {}

        def step() -> None:
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    finish[o.request_id] = o.finish_reason

        for _ in range(3):  # the prompts prefill; nothing is sampled yet
            step()
        assert not any(out.values())
        assert all(r.num_computed_tokens == r.num_prompt_tokens for r in requests.values())
        pending.set_result(None)  # their specs are in the cache since the first run
        while engine.has_work():
            step()
    finally:
        llm.close()
    assert {rid: (out[rid], finish[rid]) for rid in requests} == want
