"""Tool-call triggers that are one special token of the model's vocabulary (Mistral's
`[TOOL_CALLS]`): the grammar names the token in auto, required and named modes, the output
text keeps the trigger's text (other special tokens stay skipped) so the parser splits the
call, and a vocabulary without such a token keeps the text spelling."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import llguidance
import pytest

from tests.special_token_model import MISTRAL_TEMPLATE, TRIGGER, make_model_dir
from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.core.types import TokenLogprobs
from ultrafast.request import SamplingParams
from ultrafast.server.bridge import RequestOutput
from ultrafast.server.tools.formats import MISTRAL
from ultrafast.server.tools.plan import FunctionTool, ToolPlan
from ultrafast.tokenizer import Tokenizer

from .test_generation_run import make_run
from .test_tools_run import sse_chunks, stream_calls

ARGS_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = (FunctionTool("get_weather", parameters=ARGS_SCHEMA), FunctionTool("ping"))
CALL = '[{"name":"get_weather","arguments":{"city":"Oslo"}}]'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-vocab")
    make_model_dir(path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def trigger_id(tok):
    return tok.special_tokens[TRIGGER]


@pytest.fixture(scope="module")
def lltok(tok):
    return llguidance.LLTokenizer(tok.backend_json(), n_vocab=4096, eos_token=[0])


def plan_for(tok, **fields) -> ToolPlan:
    return ToolPlan(tools=TOOLS, **fields).for_template(tok.chat_template, tok.special_tokens)


def matcher(lltok, plan: ToolPlan) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(lltok, plan.grammar_lark(), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def allowed(m: llguidance.LLMatcher, token_id: int) -> bool:
    return bool(m.compute_bitmask()[token_id // 8] >> (token_id % 8) & 1)


def allowed_ids(m: llguidance.LLMatcher, n: int = 4096) -> list[int]:
    mask = m.compute_bitmask()
    return [t for t in range(n) if mask[t // 8] >> (t % 8) & 1]


# -- the vocabulary and the detokenizer ---------------------------------------------------------


def test_decode_keeps_only_the_named_special_tokens(tok, trigger_id):
    eos = tok.eos_token_id
    ids = [eos, *tok.encode("Hi", False), trigger_id, *tok.encode(CALL, False), eos]
    assert tok.decode(ids) == "Hi" + CALL  # default: every special token skipped, as before
    kept = tok.decode(ids, keep_ids=frozenset({trigger_id}))
    assert kept == "Hi" + TRIGGER + CALL  # the trigger stays, EOS is still skipped
    detok = tok.detokenizer([1, 2], keep_ids=frozenset({trigger_id}))
    streamed = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert streamed == kept


def test_the_plan_finds_the_trigger_token_only_in_a_vocabulary_that_has_it(tok, trigger_id):
    plan = plan_for(tok)
    assert plan.fmt is MISTRAL and plan.fmt_tokens == ((TRIGGER, trigger_id),)
    assert plan.keep_token_ids == {trigger_id}
    assert f"<[{trigger_id}]>" in plan.grammar_lark()
    assert plan_for(tok, choice="none").keep_token_ids == frozenset()  # no call: skip it
    demo = Tokenizer.from_dir(DEMO_MODEL_DIR)  # no [TOOL_CALLS] token: the text spelling
    text_plan = ToolPlan(tools=TOOLS).for_template(MISTRAL_TEMPLATE, demo.special_tokens)
    assert text_plan.fmt is MISTRAL and text_plan.keep_token_ids == frozenset()
    assert '"[TOOL_CALLS]"' in text_plan.grammar_lark() and "<[" not in text_plan.grammar_lark()


# -- the grammar ------------------------------------------------------------------------------


def test_auto_allows_the_trigger_token_in_free_text_and_then_forces_a_call(tok, lltok, trigger_id):
    m = matcher(lltok, plan_for(tok))
    assert allowed(m, trigger_id)  # a native call as the first token
    assert m.consume_tokens(lltok.tokenize_str("Let me check."))
    assert allowed(m, trigger_id)  # or after some text
    assert m.consume_token(trigger_id)
    assert m.compute_ff_bytes() == b'[{"name":"'  # inside the call grammar now
    assert m.consume_tokens(lltok.tokenize_str(CALL))
    assert m.is_accepting()


def test_auto_free_text_cannot_spell_the_trigger_out(tok, lltok):
    m = matcher(lltok, plan_for(tok))
    # the text spelling in ordinary text tokens (whole, it would tokenize to the special one)
    ids = lltok.tokenize_str("Hm " + TRIGGER[:-1]) + lltok.tokenize_str(TRIGGER[-1])
    assert len(ids) > 2 and all(not lltok.is_special_token(t) for t in ids)
    assert m.validate_tokens(ids) < len(ids)


@pytest.mark.parametrize(
    "fields",
    [
        {"choice": "required"},
        {"choice": "required", "parallel": False},
        {"choice": "function", "named": "ping"},
    ],
    ids=["required", "required-single", "named"],
)
def test_forced_calls_start_with_the_trigger_token(tok, lltok, trigger_id, fields):
    m = matcher(lltok, plan_for(tok, **fields))
    assert allowed_ids(m) == [trigger_id]  # the only first token
    assert m.consume_token(trigger_id)
    name = "ping" if fields.get("named") else "get_weather"
    body = '[{"name":"' + name + '","arguments":' + ("{}" if name == "ping" else '{"city":"x"}')
    assert m.consume_tokens(lltok.tokenize_str(body + "}"))
    single = fields.get("named") or fields.get("parallel") is False
    assert m.is_accepting() if single else m.consume_tokens(lltok.tokenize_str("]"))


def test_tool_choice_none_never_allows_the_trigger_token(tok, lltok, trigger_id):
    m = matcher(lltok, plan_for(tok, choice="none"))
    assert not allowed(m, trigger_id)
    assert m.consume_tokens(lltok.tokenize_str("Just text."))
    assert not allowed(m, trigger_id)


# -- through a GenerationRun (hand-fed engine outputs) ---------------------------------------


def mistral_run(tok, plan: ToolPlan, stream: bool):
    return make_run(
        tok,
        prompts=[[5, 6, 7]],
        params=SamplingParams(max_tokens=64, logprobs=True),
        stream=stream,
        want_logprobs=True,
        tools=plan,
        keep_token_ids=plan.keep_token_ids,
    )


def feed(engine, ids: list[int]) -> None:
    on_output = engine.callbacks["chatcmpl-t-0-0"]
    for k, token in enumerate(ids):
        last = k == len(ids) - 1
        on_output(
            RequestOutput(
                "chatcmpl-t-0-0",
                [token],
                new_logprobs=[_logprob(token)],
                finished=last,
                finish_reason="stop" if last else None,
                num_output_tokens=k + 1,
            )
        )


def _logprob(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.5, [])


def output_ids(tok, trigger_id) -> list[int]:
    return [*tok.encode("Sure.", False), trigger_id, *tok.encode(CALL, False), tok.eos_token_id]


def test_a_trigger_token_output_is_a_tool_call_and_the_stream_matches_the_body(tok, trigger_id):
    async def main():
        plan = replace(plan_for(tok), parallel=True)
        bodies = []
        for stream in (False, True):
            run, engine = mistral_run(tok, plan, stream)
            run.start()
            feed(engine, output_ids(tok, trigger_id))
            if stream:
                content, calls, finish = stream_calls(await sse_chunks(run))
            else:
                await run._drain()
            body = run.choices[0]
            bodies.append(
                (
                    body.text,
                    [(c["function"]["name"], c["function"]["arguments"]) for c in body.tool_calls],
                    body.finish_reason,
                )
            )
            if stream:
                assert (content, [(c["name"], c["arguments"]) for c in calls], finish) == bodies[0]
            run.finish()
        text, calls, finish = bodies[0]
        assert finish == "tool_calls" and text == "Sure."  # the trigger never in content
        assert calls == [("get_weather", json.dumps({"city": "Oslo"}, separators=(",", ":")))]
        assert bodies[0] == bodies[1]

    asyncio.run(main())


def test_logprobs_show_the_trigger_token_as_its_text(tok, trigger_id):
    async def main():
        run, engine = mistral_run(tok, plan_for(tok), stream=False)
        run.start()
        feed(engine, output_ids(tok, trigger_id))
        await run._drain()
        assert run.decode_token([trigger_id]) == TRIGGER
        assert run.decode_token([tok.eos_token_id]) == ""  # others stay skipped
        run.finish()

    asyncio.run(main())
