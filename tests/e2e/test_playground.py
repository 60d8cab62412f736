"""The playground at GET / in headless Chromium: a multi-turn chat kept on the server, a stop
button that frees the server's slot, per-answer TTFT / tok/s / model / tier / how it ended, and
the Markdown renderer's escaping. The rest of the page (conversation list, system prompt, model
picker, keys, phone and dark layouts): test_playground_ui.py.
"""

import json
import re
import time

import httpx
import pytest

from tests.e2e.playground_browser import (
    _answers,
    _field,
    _model_id,
    _number,
    _set_number,
    _type_and_send,
    _wait_state,
)
from ultrafast_harness.bench.server_process import ServerProcess

# wraps the page's fetch to keep every chat completion body it sends, before any click
RECORD_SENT = """
window.sentBodies = [];
const realFetch = window.fetch;
window.fetch = (url, options) => {
  if (String(url).includes("/v1/chat/completions")) window.sentBodies.push(options.body);
  return realFetch(url, options);
};
"""

SEND_NOW = 'document.getElementById("prompt").value = arguments[0]; send();'


def test_playground_page_is_served(server):
    # a browser asks for HTML; other clients get Ollama's "Ollama is running" (frontends/)
    r = httpx.get(server.url + "/", headers={"accept": "text/html,application/xhtml+xml,*/*"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    for needle in (
        'id="send"',
        'id="stop"',
        'id="tier"',
        "/v1/chat/completions",
        "/v1/conversations",
        "session_id",
    ):
        assert needle in r.text
    assert "<script src" not in r.text and "stylesheet" not in r.text  # one file, nothing else
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in r.text
    assert "prefers-color-scheme: dark" in r.text
    for needle in ('id="system_prompt"', 'id="top_p"', 'id="temperature"', 'id="conversations"'):
        assert needle in r.text
    # the message box starts empty, with a placeholder
    prompt = re.search(r'<textarea id="prompt" placeholder="([^"]+)">(.*?)</', r.text, re.S)
    assert prompt and prompt.group(1) and prompt.group(2) == ""
    assert "/*STYLE*/" not in r.text and "/*SCRIPT*/" not in r.text  # everything inlined


@pytest.mark.parametrize("tier", ["priority", "default", "flex"])
def test_playground_streams_with_live_stats(server, browser, tier):
    from selenium.webdriver.support.ui import Select

    browser.get(server.url + "/")
    Select(browser.find_element("id", "tier")).select_by_value(tier)
    _set_number(browser, "max_tokens", 24)
    _set_number(browser, "temperature", 0)  # greedy: the demo model runs to max_tokens
    _type_and_send(browser, "def f(x):")
    state = _wait_state(browser, ("done", "length", "error", "stopped"))
    assert state == "length", browser.find_element("id", "output").text  # cut at max_tokens
    answer = _answers(browser)[-1]
    assert _field(answer, "state") == "length"
    assert _field(answer, "body").strip()  # streamed text arrived
    ttft = _number(answer, "ttft")
    tps = _number(answer, "tps")
    assert ttft is not None and ttft > 0
    assert tps is not None and tps > 0
    assert _number(answer, "ntokens") == 24  # usage count shown at the end
    assert _field(answer, "served_tier") == tier
    assert _field(answer, "served_model") == _model_id(server)
    assert Select(browser.find_element("id", "model")).first_selected_option.text == _model_id(
        server
    )


def test_playground_shows_an_api_error(server, browser):
    browser.get(server.url + "/")
    _set_number(browser, "max_tokens", 0)  # refused by the server with a 400 envelope
    _type_and_send(browser, "hello")
    assert _wait_state(browser, ("done", "length", "error")) == "error"
    answer = _answers(browser)[-1]
    assert "400" in answer.find_element("css selector", ".error").text
    assert _field(answer, "ttft") == "-"
    assert browser.find_element("id", "send").is_enabled()  # ready for the next try
    assert not browser.find_element("id", "stop").is_enabled()


LONG_ANSWER = 1800  # tokens: seconds of decoding, far longer than a click takes


def _generated_tokens(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith('ultrafast_generation_tokens_total{tenant="anonymous"}'):
            return float(line.split()[-1])
    raise AssertionError("no ultrafast_generation_tokens_total in /metrics")


def _wait_idle(server, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        ready = httpx.get(server.url + "/ready").json()
        if (ready["running"] == 0 and ready["kv_slots_busy"] == 0) or time.monotonic() > deadline:
            return ready
        time.sleep(0.1)


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """Room for a long answer (so Stop lands mid-stream even on a busy machine) and a
    conversation store of its own."""
    db = tmp_path_factory.mktemp("playground") / "sessions.db"
    srv = ServerProcess(
        "--priority-ttft-ms", "10000", "--session-store", f"sqlite:///{db}", max_model_len=2048
    )
    yield srv
    srv.stop()


def test_two_turns_and_a_stop_keep_one_conversation_on_the_server(chat_server, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    server = chat_server

    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_SENT})
    browser.get(server.url + "/")
    turns = ["def add(a, b):\n    return", "Write a long parser in Python.", "def sub(a, b):"]

    # turn 1: typed with Shift+Enter for the newline, sent with Enter
    _set_number(browser, "max_tokens", 16)
    _set_number(browser, "temperature", 0)  # greedy: each answer runs to max_tokens
    _type_and_send(browser, turns[0])
    assert _wait_state(browser, ("done", "length", "error", "stopped")) == "length"
    conversation = browser.find_element("id", "conversation").text
    assert conversation.startswith("conv")

    # turn 2: a long answer, stopped as soon as its first token shows
    generated_before = _generated_tokens(server)
    _set_number(browser, "max_tokens", LONG_ANSWER)
    _type_and_send(browser, turns[1])
    WebDriverWait(browser, 60, poll_frequency=0.02).until(
        lambda d: len(_answers(d)) == 2 and _field(_answers(d)[1], "ttft") != "-"
    )
    browser.find_element("id", "stop").click()
    WebDriverWait(browser, 30, poll_frequency=0.02).until(
        lambda d: _field(_answers(d)[1], "state") != "streaming"
    )
    # turn 3 sent at once, before the server can have stored the stopped answer: the page
    # waits for that, so the history keeps its order
    _set_number(browser, "max_tokens", 16)
    browser.execute_script(SEND_NOW, turns[2])
    assert _wait_state(browser, ("done", "length", "error", "stopped")) == "length"
    stopped = _answers(browser)[1]
    assert _field(stopped, "state") == "stopped", _field(stopped, "ntokens")
    assert _field(stopped, "body").strip()  # the text that came before the stop stays
    assert 0 < _number(stopped, "ntokens") < LONG_ANSWER
    ready = _wait_idle(server)
    assert ready["running"] == 0 and ready["kv_slots_busy"] == 0, ready
    # the server stopped decoding the long answer: turns 2 and 3 together made fewer tokens
    # than turn 2 alone would have made had it run to its max_tokens (how many fewer depends
    # on how long the browser's click takes against this machine's decode speed)
    assert _generated_tokens(server) - generated_before < LONG_ANSWER
    assert browser.find_element("id", "conversation").text == conversation
    answers = _answers(browser)
    assert len(answers) == 3
    model = _model_id(server)
    for answer in (answers[0], answers[2]):
        assert _field(answer, "body").strip()
        assert _number(answer, "ttft") > 0 and _number(answer, "tps") > 0
        assert _number(answer, "ntokens") == 16
        assert _field(answer, "served_model") == model
        assert _field(answer, "served_tier") == "priority"

    # each request carried only its new message; the server holds all the turns
    sent = [json.loads(body) for body in browser.execute_script("return window.sentBodies")]
    assert [b["messages"] for b in sent] == [[{"role": "user", "content": t}] for t in turns]
    assert {b["session_id"] for b in sent} == {conversation}
    # sampling fields left empty are left out (the model's defaults), those set are sent
    assert all(b["temperature"] == 0 and "top_p" not in b for b in sent)
    items = httpx.get(
        f"{server.url}/v1/conversations/{conversation}/items", params={"order": "asc"}
    ).json()["data"]
    assert [i["role"] for i in items] == ["user", "assistant"] * 3
    assert [i["content"][0]["text"] for i in items[0::2]] == turns
    assert [i["status"] for i in items[1::2]] == ["completed", "incomplete", "completed"]
    assert items[3]["content"][0]["text"].strip()  # the stopped answer's text is kept


NEW_TAB = 'target="_blank" rel="noopener noreferrer"'
MARKDOWN_CASES = [
    # (source, html the renderer must produce)
    ("<script>alert(1)</script>", "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>"),
    (
        "```python\nif a < b:\n    pass\n```",
        '<pre><code class="language-python">if a &lt; b:\n    pass</code></pre>',
    ),
    ("```\nopen fence", "<pre><code>open fence</code></pre>"),  # while still streaming
    (
        "use `x<y` and **bold** and *it*",
        "<p>use <code>x&lt;y</code> and <strong>bold</strong> and <em>it</em></p>",
    ),
    ("- one\n- two\n\n1. first", "<ul><li>one</li><li>two</li></ul><ol><li>first</li></ol>"),
    (
        "[ok](https://example.com/a_b_c)",
        f'<p><a href="https://example.com/a_b_c" {NEW_TAB}>ok</a></p>',
    ),
    ("[bad](javascript:alert(1))", "<p>[bad](javascript:alert(1))</p>"),
    (
        '[q](https://x.org/"onmouseover="a)',
        f'<p><a href="https://x.org/&quot;onmouseover=&quot;a" {NEW_TAB}>q</a></p>',
    ),
    ("snake_case_name and __init__", "<p>snake_case_name and __init__</p>"),
    ("def f(*args, **kwargs): a * b * c", "<p>def f(*args, **kwargs): a * b * c</p>"),
    ("_x_ and __y__", "<p><em>x</em> and __y__</p>"),
    ("# Title", "<h3>Title</h3>"),
]


def test_markdown_renderer_escapes_first(server, browser):
    browser.get(server.url + "/")
    got = browser.execute_script(
        "return arguments[0].map((s) => renderMarkdown(s))", [s for s, _ in MARKDOWN_CASES]
    )
    assert got == [html for _, html in MARKDOWN_CASES]
