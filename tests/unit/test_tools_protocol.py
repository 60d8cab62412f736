"""Tool calling's request side: bad tool input answers 400 naming the exact param, the tools
reach the prompt (through the template's own tool support, or our generic system block), and
the history's calls and results are rendered so the model can follow them."""

from __future__ import annotations

import pytest

from ultrafast.server.prompt.chat_tokens import ChatMessage
from ultrafast.server.protocol import parse_chat_request
from ultrafast.server.tools.formats import GENERIC, HERMES, LLAMA3_JSON, MISTRAL, detect_format
from ultrafast.server.tools.plan import chat_tool_plan
from ultrafast.tokenizer import Tokenizer

from .test_protocol import ALL_FEATURES, IV, chat, refusal, tool

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"q":1}'}}
HISTORY = [
    {"role": "user", "content": "q?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
]


@pytest.mark.parametrize(
    "body, param",
    [
        (chat(tools=[tool("a"), tool("a")]), "tools[1].function.name"),
        (
            chat(tools=[tool("a")], tool_choice={"type": "function", "function": {"name": "b"}}),
            "tool_choice",
        ),
        (chat(tools=[tool("a", {"type": "string"})]), "tools[0].function.parameters"),
        (
            chat(tools=[tool("a", {"type": "object", "minLength": "x"})]),
            "tools[0].function.parameters.minLength",
        ),
        (
            {
                "messages": [
                    HISTORY[0],
                    {
                        **HISTORY[1],
                        "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    HISTORY[0],
                    {
                        **HISTORY[1],
                        "tool_calls": [
                            {**CALL, "function": {"name": "f", "arguments": "{not json"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_input_names_the_param(body, param):
    assert refusal(parse_chat_request, body, ALL_FEATURES) == (400, IV, param)


def test_a_parameter_keyword_we_cannot_enforce_is_named_by_its_path():
    schema = {"type": "object", "properties": {"x": {"type": "string", "not": {"const": "a"}}}}
    status, _, param = refusal(parse_chat_request, chat(tools=[tool("a", schema)]), ALL_FEATURES)
    assert (status, param) == (400, "tools[0].function.parameters.properties.x.not")


def test_plan_from_the_request():
    req = parse_chat_request(
        chat(
            tools=[tool("a"), tool("b", {"type": "object"})],
            tool_choice={"type": "function", "function": {"name": "b"}},
            stream=True,
            stream_options={"include_tool_call_done": True},
        ),
        ALL_FEATURES,
    )
    plan = chat_tool_plan(req)
    assert plan is not None and plan.named == "b" and plan.single and plan.done_events
    lark = plan.grammar_lark() or ""
    assert '\\"b\\"' in lark and '\\"a\\"' not in lark  # only the named function
    req = parse_chat_request(chat(tools=[tool("a")], parallel_tool_calls=False), ALL_FEATURES)
    plan = chat_tool_plan(req)
    assert plan.choice == "auto" and plan.single and not plan.done_events
    plan = chat_tool_plan(
        parse_chat_request(chat(tools=[tool("a")], tool_choice="none"), ALL_FEATURES)
    )
    assert plan.parser() is None and "~/" in (plan.grammar_lark() or "")  # the trigger banned


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function.name }};"
    "{% endfor %}</tools>\nCall with <tool_call></tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


@pytest.mark.parametrize(
    "template, expected",
    [
        (HERMES_TEMPLATE, HERMES),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", GENERIC),
        ("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}{% endif %}[TOOL_CALLS]", MISTRAL),
        ('{% if tools %}<|python_tag|>{"name": ..., "parameters": ...}{% endif %}', LLAMA3_JSON),
        (None, GENERIC),
    ],
)
def test_format_is_detected_from_the_template(template, expected):
    assert detect_format(template) is expected


def messages():
    return [
        ChatMessage(
            m["role"],
            m["content"] or "",
            extra={k: v for k, v in m.items() if k not in ("role", "content")},
        )
        for m in HISTORY
    ]


def plan_for(template, **fields):
    req = parse_chat_request(
        {"messages": HISTORY, "tools": [tool("f"), tool("g")], **fields}, ALL_FEATURES
    )
    return chat_tool_plan(req).for_template(template)


def test_generic_format_lists_tools_and_renders_history_as_text():
    plan = plan_for(None)
    rendered, variables = plan.render(messages())
    assert variables == {}
    assert rendered[0].role == "system" and '"name": "f"' in rendered[0].content
    assert '<tool_call>{"name":"f","arguments":{"q":1}}</tool_call>' in rendered[2].content
    assert (
        rendered[3].role == "user"
        and rendered[3].content == "<tool_response>\n42\n</tool_response>"
    )
    none_rendered, _ = plan_for(None, tool_choice="none").render(messages())
    assert none_rendered[0].role == "user"  # no tools shown when none may be called


class TemplateTokenizer(Tokenizer):
    """Only the template half of a Tokenizer: enough to render."""

    def __init__(self, template: str):
        from ultrafast.tokenizer import _template_env

        self.chat_template = template
        self._template_problem = None
        self._template = _template_env().from_string(template)
        self.bos_token = self.eos_token = ""


def test_native_template_gets_tools_and_object_arguments():
    tok = TemplateTokenizer(HERMES_TEMPLATE)
    plan = plan_for(tok.chat_template)
    assert plan.fmt is HERMES
    rendered, variables = plan.render(messages())
    text = tok.apply_chat_template([m.for_template() for m in rendered], **variables)
    assert "<tools>f;g;</tools>" in text
    assert '<tool_call>{"q": 1}</tool_call>' in text  # arguments reached it as an object
