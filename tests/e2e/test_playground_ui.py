"""The playground as a page people keep open, in headless Chromium: the conversation list read
back from the server after a reload, the system prompt, copy and regenerate, the model picker
with `--models`, the API-key prompt, the phone layout, dark mode and the fonts.

With ULTRAFAST_PLAYGROUND_SCREENSHOT=path.png, `test_screenshot_of_the_default_model` saves the
README's screenshot (docs/playground.png) of SmolLM2 answering.
"""

import os

import httpx
import pytest

from tests.e2e.playground_browser import (
    _answers,
    _conversation_items,
    _field,
    _set_number,
    _type_and_send,
    _wait_state,
)
from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench.server_process import ServerProcess

ENDED = ("done", "length", "error", "stopped")
# records what the page copies (headless Chromium has no clipboard to read back)
RECORD_COPY = """
window.copied = [];
navigator.clipboard.writeText = async (text) => { window.copied.push(text); };
"""


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    db = tmp_path_factory.mktemp("playground-ui") / "sessions.db"
    srv = ServerProcess("--priority-ttft-ms", "10000", "--session-store", f"sqlite:///{db}")
    yield srv
    srv.stop()


def _list_titles(driver) -> list[str]:
    return _texts(driver, "#conversations .open")


def _conversation(driver) -> str:
    return driver.find_element("id", "conversation").text


def _texts(driver, css: str) -> list[str]:
    """The text of each element `css` selects, read in one go (the page re-renders lists)."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((e) => e.innerText)", css
    )


def _send(driver, text: str, max_tokens: int = 8, timeout_s: float = 60) -> str:
    """Sends `text` greedily (the answer runs to `max_tokens`: "length"); the state it ended in."""
    _set_number(driver, "max_tokens", max_tokens)
    if not driver.find_element("id", "temperature").get_attribute("value"):
        _set_number(driver, "temperature", 0)
    _type_and_send(driver, text)
    return _wait_state(driver, ENDED, timeout_s)


def test_conversations_survive_a_reload(chat_server, browser):
    server = chat_server
    browser.get(server.url + "/")
    browser.find_element("id", "system_prompt").send_keys("You answer in Python.")
    assert _send(browser, "first chat\nsecond line") == "length"
    first = _conversation(browser)
    items = _conversation_items(server, first)
    assert [(i["role"], i["content"][0]["text"]) for i in items[:2]] == [
        ("system", "You answer in Python."),
        ("user", "first chat\nsecond line"),
    ]
    assert httpx.get(f"{server.url}/v1/conversations/{first}").json()["metadata"] == {
        "title": "first chat"
    }
    browser.find_element("id", "new_chat").click()
    assert _send(browser, "another one") == "length"
    second = _conversation(browser)
    assert second != first and _list_titles(browser) == ["another one", "first chat"]

    browser.refresh()  # the list and the open conversation come back from the server
    _wait_for(browser, lambda d: _list_titles(d) == ["another one", "first chat"])
    assert _conversation(browser) == second
    answer = _conversation_items(server, second)[-1]["content"][0]["text"]
    _wait_for(browser, lambda d: _texts(d, ".turn.user") == ["another one"])
    shown = _answers(browser)[0].find_element("css selector", ".body").get_attribute("innerHTML")
    assert shown == browser.execute_script("return renderMarkdown(arguments[0])", answer)
    assert _field(_answers(browser)[0], "state") == "stored"

    browser.find_elements("css selector", "#conversations .open")[1].click()
    _wait_for(browser, lambda d: _conversation(d) == first)
    _wait_for(browser, lambda d: _texts(d, ".turn.system") == ["You answer in Python."])
    assert _texts(browser, ".turn.user") == ["first chat\nsecond line"]

    browser.find_elements("css selector", "#conversations .forget")[1].click()  # delete it
    _wait_for(browser, lambda d: _list_titles(d) == ["another one"])
    assert httpx.get(f"{server.url}/v1/conversations/{first}").status_code == 404
    assert _conversation(browser) == "new"


def test_copy_and_regenerate(chat_server, browser):
    server = chat_server
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_COPY})
    browser.get(server.url + "/")
    assert _send(browser, "def add(a, b):", max_tokens=6) == "length"
    assert _send(browser, "def sub(a, b):", max_tokens=6) == "length"
    old = _conversation(browser)
    first_answer = _conversation_items(server, old)[1]["content"][0]["text"]
    _answers(browser)[0].find_element("css selector", ".copy").click()
    _wait_for(browser, lambda d: d.execute_script("return window.copied") == [first_answer])
    # only the last answer can be regenerated
    assert [len(a.find_elements("css selector", ".regenerate")) for a in _answers(browser)] == [
        0,
        1,
    ]

    _answers(browser)[1].find_element("css selector", ".regenerate").click()
    _wait_for(browser, lambda d: _conversation(d) not in (old, "new"))
    assert _wait_state(browser, ENDED) == "length"
    new = _conversation(browser)
    assert httpx.get(f"{server.url}/v1/conversations/{old}").status_code == 404
    items = _conversation_items(server, new)
    assert [(i["role"], i["content"][0]["text"]) for i in items[:3]] == [
        ("user", "def add(a, b):"),
        ("assistant", first_answer),
        ("user", "def sub(a, b):"),
    ]
    assert [i["role"] for i in items] == ["user", "assistant", "user", "assistant"]
    assert _texts(browser, ".turn.user") == ["def add(a, b):", "def sub(a, b):"]
    assert len(_answers(browser)) == 2
    assert _list_titles(browser) == ["def add(a, b):"]  # the same entry, now the new id


def test_model_picker_offers_every_served_model(browser):
    from selenium.webdriver.support.ui import Select

    models = f"alpha={DEMO_MODEL_DIR},beta={DEMO_MODEL_DIR}"
    srv = ServerProcess("--priority-ttft-ms", "10000", "--models", models, model=None)
    try:
        browser.get(srv.url + "/")
        _wait_for(browser, lambda d: _texts(d, "#model option") == ["alpha", "beta"])
        Select(browser.find_element("id", "model")).select_by_value("beta")
        assert _send(browser, "def f(x):", max_tokens=4) == "length"
        assert _field(_answers(browser)[0], "served_model") == "beta"
        browser.refresh()  # the choice is remembered
        _wait_for(browser, lambda d: d.find_element("id", "model").get_attribute("value") == "beta")
    finally:
        srv.stop()


def test_with_keys_on_the_page_loads_and_asks_for_one(browser):
    srv = ServerProcess("--priority-ttft-ms", "10000", "--api-key", "sk-page")
    try:
        browser.get(srv.url + "/")
        _wait_for(browser, lambda d: d.find_element("id", "key_panel").is_displayed())
        assert _texts(browser, "#model option") == []
        browser.find_element("id", "api_key").send_keys("sk-wrong\n")
        _wait_for(browser, lambda d: "refused" in d.find_element("id", "key_message").text)
        browser.find_element("id", "api_key").send_keys("sk-page\n")
        _wait_for(browser, lambda d: not d.find_element("id", "key_panel").is_displayed())
        assert len(_texts(browser, "#model option")) == 1
        assert _send(browser, "def f(x):", max_tokens=4) == "length"
        browser.refresh()  # the key is kept in the browser
        _wait_for(browser, lambda d: len(_texts(d, "#model option")) == 1)
        assert not browser.find_element("id", "key_panel").is_displayed()
        assert browser.execute_script("return localStorage.getItem('ultrafast.apiKey')") == (
            '"sk-page"'
        )
    finally:
        srv.stop()


def test_phone_layout(chat_server, phone):
    phone.get(chat_server.url + "/")
    width = phone.execute_script("return window.innerWidth")
    assert width == 390  # the viewport tag: laid out at the phone's width, not shrunk
    assert phone.execute_script("return document.documentElement.scrollWidth") <= width
    right = "return document.getElementById(arguments[0]).getBoundingClientRect().right"
    for element_id in ("prompt", "send", "stop", "model"):
        assert 0 < phone.execute_script(right, element_id) <= width, element_id
    assert phone.execute_script(right, "sidebar") <= 0  # the list is a drawer, closed
    assert not phone.find_element("id", "settings").get_attribute("open")
    phone.find_element("id", "chats_toggle").click()
    _wait_for(phone, lambda d: d.execute_script(right, "sidebar") > 100)
    phone.execute_script("document.getElementById('output').click()")  # a tap beside it
    _wait_for(phone, lambda d: d.execute_script(right, "sidebar") <= 0)
    phone.find_element("id", "chats_toggle").click()
    _wait_for(phone, lambda d: d.execute_script(right, "sidebar") > 100)
    phone.find_element("id", "new_chat").click()  # closes the drawer
    _wait_for(phone, lambda d: d.execute_script(right, "sidebar") <= 0)
    phone.find_element("css selector", "#settings summary").click()
    assert _send(phone, "def f(x):", max_tokens=4) == "length"
    assert phone.execute_script("return document.documentElement.scrollWidth") <= width


BACKGROUND = "return getComputedStyle(document.body).backgroundColor"
FONT = "return getComputedStyle(document.querySelector(arguments[0])).fontFamily"


def _brightness(css_color: str) -> float:
    red, green, blue = (int(v) for v in css_color[css_color.index("(") + 1 : -1].split(",")[:3])
    return (red + green + blue) / 3


def test_dark_mode_follows_the_system_and_fonts(chat_server, browser):
    browser.get(chat_server.url + "/")
    assert _brightness(browser.execute_script(BACKGROUND)) > 200
    browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
    )
    assert _brightness(browser.execute_script(BACKGROUND)) < 60
    got = browser.execute_script(
        "const t = document.createElement('div'); t.className = 'turn assistant';"
        "t.innerHTML = '<div class=\"body\">' + renderMarkdown(arguments[0]) + '</div>';"
        "document.getElementById('output').appendChild(t); return 1",
        "Some prose.\n\n```python\nx = 1\n```",
    )
    assert got == 1
    prose, code = browser.execute_script(FONT, ".body p"), browser.execute_script(FONT, ".body pre")
    assert "monospace" not in prose and "system-ui" in prose
    assert "monospace" in code
    assert "monospace" not in browser.execute_script(FONT, "#prompt")


def test_screenshot_of_the_default_model(browser):
    """docs/playground.png: SmolLM2 (the default model) in a two-turn chat."""
    path = os.environ.get("ULTRAFAST_PLAYGROUND_SCREENSHOT")
    if not path:
        pytest.skip("set ULTRAFAST_PLAYGROUND_SCREENSHOT=path.png to take the screenshot")
    from ultrafast.config import smollm2_gguf

    if not smollm2_gguf().is_file():
        pytest.skip(f"SmolLM2 is not fetched ({smollm2_gguf()}): python -m ultrafast.model_fetch")
    srv = ServerProcess(
        "--priority-ttft-ms",
        "10000",
        model=smollm2_gguf(),
        max_model_len=2048,
        startup_timeout_s=600,  # under load, the start-up calibration takes minutes
    )
    try:
        browser.set_window_size(1200, 1000)
        browser.get(srv.url + "/")
        browser.find_element("id", "temperature").send_keys("0.2")  # the model card's sampling
        browser.find_element("id", "top_p").send_keys("0.9")
        for question in (
            "Write a Python function that reverses a string.",
            "How would I test it with pytest?",
        ):  # minutes on a loaded machine
            assert _send(browser, question, max_tokens=200, timeout_s=600) in ENDED
        browser.save_screenshot(path)
    finally:
        srv.stop()


def _wait_for(driver, condition, timeout_s: float = 30):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, timeout_s, ignored_exceptions=[StaleElementReferenceException])
    wait.until(condition)
