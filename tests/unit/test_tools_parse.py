"""The tool-call stream parser: content and calls apart, at any chunking, and the streamed
pieces concatenate to exactly the final calls (empty `{}`, braces and quotes inside strings,
a non-string first argument: the shapes vLLM's and llama.cpp's parsers broke on)."""

from __future__ import annotations

import pytest

from ultrafast.server.tools.formats import FORMATS, GENERIC, HERMES, LLAMA3_JSON, MISTRAL
from ultrafast.server.tools.parse import CallArgs, CallDone, CallStart, Content, ToolCallParser

ARGS = [
    "{}",
    '{"a":"}{\\"x"}',
    '{"n":5,"s":"t"}',
    '{"list":[1,{"b":"]"}],"q":"\\\\"}',
]


def run(fmt, text: str, sizes: list[int]):
    parser = ToolCallParser(fmt)
    events, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        events += parser.push(text[i : i + n])
        i, k = i + n, k + 1
    return events + parser.finish(), parser


def summarize(events):
    """content, and per call: (id, name, streamed args, final args, complete)"""
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index not in calls, "one start per call"
            calls[e.index] = [e.id, e.name, "", None, None]
        elif isinstance(e, CallArgs):
            calls[e.index][2] += e.fragment
        elif isinstance(e, CallDone):
            assert calls[e.index][0] == e.id and calls[e.index][1] == e.name
            calls[e.index][3], calls[e.index][4] = e.arguments, e.complete
    return content, [tuple(calls[i][1:]) for i in sorted(calls)]


def call_block(fmt, name, args, spaced=False):
    sep = ", " if spaced else ","
    body = '{"name":' + (" " if spaced else "") + f'"{name}"{sep}"{fmt.args_key}":' + args + "}"
    if fmt.array:
        return fmt.trigger + fmt.begin + body + fmt.end
    return (body if fmt.trigger_in_call else fmt.trigger + fmt.begin + body) + fmt.end


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("args", ARGS)
@pytest.mark.parametrize("sizes", [[1], [2, 5], [1000]])
def test_one_call_streams_to_exactly_the_final_arguments(fmt, args, sizes):
    lead = "" if fmt is LLAMA3_JSON else "Checking. "
    events, parser = run(fmt, lead + call_block(fmt, "get_x", args), sizes)
    content, calls = summarize(events)
    assert content == lead
    assert calls == [("get_x", args, args, True)]
    assert [c.arguments for c in parser.calls] == [args]


def test_whitespace_between_tokens_and_keys_in_any_order():
    text = '<tool_call>\n{ "arguments" : {"q": [1, 2]} ,  "name" : "f" }\n</tool_call>'
    content, calls = summarize(run(HERMES, text, [3])[0])
    assert content == ""
    assert calls == [("f", '{"q": [1, 2]}', '{"q": [1, 2]}', True)]


def test_a_call_without_arguments_gets_empty_object():
    content, calls = summarize(run(GENERIC, '<tool_call>{"name":"ping"}</tool_call>', [4])[0])
    assert calls == [("ping", "{}", "{}", True)]


def test_two_hermes_blocks_are_two_calls_and_whitespace_between_is_dropped():
    text = call_block(HERMES, "a", '{"x":1}') + "\n" + call_block(HERMES, "b", "{}") + "\n"
    content, calls = summarize(run(HERMES, text, [2])[0])
    assert content == ""
    assert [c[0] for c in calls] == ["a", "b"]


def test_mistral_array_holds_parallel_calls():
    text = '[TOOL_CALLS][{"name":"a","arguments":{"x":"]"}}, {"name":"b","arguments":{}}]'
    content, calls = summarize(run(MISTRAL, text, [1])[0])
    assert [(c[0], c[2]) for c in calls] == [("a", '{"x":"]"}'), ("b", "{}")]


def test_text_that_only_looks_like_a_trigger_stays_content():
    text = "a <tool_cal> b <tool_call oops> c <tool_ca"
    content, calls = summarize(run(GENERIC, text, [1])[0])
    assert content == text and calls == []


def test_output_cut_inside_a_call_ends_it_incomplete():
    events, parser = run(GENERIC, '<tool_call>{"name":"f","arguments":{"a":"x', [3])
    content, calls = summarize(events)
    assert calls == [("f", '{"a":"x', '{"a":"x', False)]
    assert not parser.calls[0].complete


def test_call_done_comes_the_moment_the_object_closes():
    parser = ToolCallParser(GENERIC)
    events = parser.push('<tool_call>{"name":"f","arguments":{"a":1}')
    assert not any(isinstance(e, CallDone) for e in events)
    events = parser.push("}")  # the call object closes: done, with nothing else
    assert [type(e) for e in events] == [CallDone]
    assert isinstance(events[-1], CallDone) and events[-1].arguments == '{"a":1}'


def test_other_keys_with_escaped_quotes_are_skipped():
    text = '<tool_call>{"x\\"y\\\\":{"name":"no"},"name":"f","arguments":{"k":"\\\\"}}</tool_call>'
    content, calls = summarize(run(GENERIC, text, [1])[0])
    assert content == "" and calls == [("f", '{"k":"\\\\"}', '{"k":"\\\\"}', True)]
