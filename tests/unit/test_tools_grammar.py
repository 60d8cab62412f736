"""The tool-call grammar (llguidance Lark) against tokenized outputs on the demo model's
vocabulary: what each tool_choice admits, what it refuses, and where a single call ends."""

from __future__ import annotations

import json

import llguidance
import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.server.tools.formats import FORMATS, GENERIC, HERMES
from ultrafast.server.tools.grammar import ToolSchema, no_call_lark, tool_call_lark
from ultrafast.server.tools.parse import ToolCallParser
from ultrafast.server.tools.render import calls_text

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [ToolSchema("get_weather", WEATHER), ToolSchema("ping", None)]


@pytest.fixture(scope="module")
def tok():
    return llguidance.LLTokenizer(str(DEMO_MODEL_DIR / "tokenizer.json"))


def accepts(tok, lark: str, text: str) -> llguidance.LLMatcher | None:
    """The matcher after `text`, or None if the grammar refused a token of it."""
    matcher = llguidance.LLMatcher(tok, lark, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tok.tokenize_str(text))
    return matcher if ok and not matcher.is_error() else None


def calls(fmt, *pairs) -> str:
    return calls_text(
        fmt, [{"function": {"name": n, "arguments": json.dumps(a)}} for n, a in pairs]
    )


def only_eos_next(tok, matcher) -> bool:
    mask = matcher.compute_bitmask()
    allowed = [t for t in range(tok.vocab_size) if mask[t // 8] >> (t % 8) & 1]
    return allowed == [tok.eos_token]


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_required_forces_a_schema_valid_call(tok, fmt):
    lark = tool_call_lark(fmt, TOOLS, required=True, single=False)
    text = calls(fmt, ("get_weather", {"city": 'P}{"a'}), ("ping", {}))
    if fmt.trigger_in_call or fmt.array:
        text = calls(fmt, ("get_weather", {"city": 'P}{"a'}))
    assert accepts(tok, lark, text).is_accepting()
    assert accepts(tok, lark, "Sure, " + text) is None  # no text before a required call
    assert accepts(tok, lark, calls(fmt, ("nope", {}))) is None  # only the listed tools
    assert accepts(tok, lark, calls(fmt, ("get_weather", {"town": "x"}))) is None  # schema
    assert accepts(tok, lark, calls(fmt, ("get_weather", {"city": 3}))) is None


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_single_call_ends_at_its_closing_brace(tok, fmt):
    lark = tool_call_lark(fmt, TOOLS, required=True, single=True)
    body = '{"name":"ping","' + fmt.args_key + '":{}}'
    text = body if fmt.trigger_in_call else fmt.trigger + fmt.begin + body
    matcher = accepts(tok, lark, text)
    assert matcher is not None and matcher.is_accepting()
    assert only_eos_next(tok, matcher)


def test_auto_lets_text_run_and_constrains_the_call_after_the_trigger(tok):
    lark = tool_call_lark(GENERIC, TOOLS, required=False, single=False)
    assert accepts(tok, lark, "Just an answer, no tools.").is_accepting()
    good = "Let me look. " + calls(GENERIC, ("get_weather", {"city": "Oslo", "days": 2}))
    assert accepts(tok, lark, good).is_accepting()
    assert accepts(tok, lark, 'Let me look. <tool_call>{"name":"nope"') is None
    bad_args = "Hm. " + calls(GENERIC, ("get_weather", {"city": "Oslo", "days": "two"}))
    assert accepts(tok, lark, bad_args) is None


def test_auto_single_allows_one_call_then_only_eos(tok):
    lark = tool_call_lark(HERMES, TOOLS, required=False, single=True)
    matcher = accepts(tok, lark, 'Ok <tool_call>\n{"name":"ping","arguments":{}}')
    assert matcher is not None and only_eos_next(tok, matcher)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_what_the_grammar_admits_the_parser_reads_back(tok, fmt):
    """The grammar's own forced text, parsed, is one whole call: a function without
    parameters takes none, so its call is forced to its end, arguments `{}` included."""
    lark = tool_call_lark(fmt, [ToolSchema("ping", None)], required=True, single=True)
    matcher = llguidance.LLMatcher(tok, lark, log_level=0)
    text = tok.decode_str(matcher.compute_ff_tokens())
    assert text.endswith('"ping","' + fmt.args_key + '":{}}')
    assert accepts(tok, lark, text) is not None
    parser = ToolCallParser(fmt)
    parser.push(text)
    parser.finish()
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [("ping", "{}", True)]


def test_listed_properties_are_the_only_ones_unless_the_schema_opens_it(tok):
    listed = {"type": "object", "properties": {"city": {"type": "string"}}}
    opened = {**listed, "additionalProperties": True}
    extra = calls(GENERIC, ("f", {"city": "x", "other": 1}))
    for schema, ok in ((listed, False), (opened, True)):
        lark = tool_call_lark(GENERIC, [ToolSchema("f", schema)], required=True, single=False)
        assert (accepts(tok, lark, extra) is not None) is ok
        assert accepts(tok, lark, calls(GENERIC, ("f", {"city": "x"}))) is not None


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_none_never_lets_a_call_start(tok, fmt):
    lark = no_call_lark(fmt)
    assert accepts(tok, lark, "Plain text, {braces} and <tags>.").is_accepting()
    assert accepts(tok, lark, "Sure: " + fmt.trigger) is None
    assert accepts(tok, lark, "Sure: " + fmt.trigger[:-1]) is not None
