"""The tool grammar with a response_format beside it (calls OR the schema's JSON, never free
text) and the per-turn call cap, on the demo model's vocabulary (no model weights)."""

from __future__ import annotations

import llguidance
import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.grammar import GrammarSpec
from ultrafast.server.tools.formats import GENERIC, HERMES, MISTRAL
from ultrafast.server.tools.plan import FunctionTool, ToolPlan

ANSWER = GrammarSpec.from_json_schema(
    {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 10}},
        "required": ["answer"],
        "additionalProperties": False,
    }
)
PLAN = ToolPlan(tools=(FunctionTool("ping"),))
CALL = '<tool_call>{"name":"ping","arguments":{}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return llguidance.LLTokenizer(str(DEMO_MODEL_DIR / "tokenizer.json"))


def complete(tok, spec: GrammarSpec, text: str) -> bool:
    m = llguidance.LLMatcher(tok, spec.lark, log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()


def test_auto_with_a_format_is_calls_or_its_json(tok):
    spec = PLAN.grammar(ANSWER)
    assert spec is not None and spec.source == "tools"
    assert complete(tok, spec, '{"answer":"hi"}')
    assert complete(tok, spec, CALL)
    assert not complete(tok, spec, "Sure, here it is")
    assert not complete(tok, spec, '{"answer":"far too long"}')
    assert not complete(tok, spec, 'text then <tool_call>{"name":"ping","arguments":{}}')


def test_none_with_a_format_is_the_format_and_required_is_a_call(tok):
    assert ToolPlan(PLAN.tools, "none").grammar(ANSWER) is ANSWER
    required = ToolPlan(PLAN.tools, "required").grammar(ANSWER)
    assert required is not None and complete(tok, required, CALL)
    assert not complete(tok, required, '{"answer":"hi"}')


@pytest.mark.parametrize("fmt", [GENERIC, HERMES, MISTRAL])
def test_the_call_cap_ends_the_turn(tok, fmt):
    plan = ToolPlan(PLAN.tools, "required", fmt=fmt, max_calls=3)
    spec = plan.grammar()

    def text(n: int) -> str:
        call = '{"name":"ping","arguments":{}}'
        if fmt.array:
            return fmt.open_text() + fmt.separator.join([call] * n) + fmt.end
        return fmt.separator.join([fmt.open_text() + call + fmt.end] * n)

    assert complete(tok, spec, text(1)) and complete(tok, spec, text(3))
    m = llguidance.LLMatcher(tok, spec.lark, log_level=0)
    assert not (m.consume_tokens(tok.tokenize_str(text(4))) and m.is_accepting())
