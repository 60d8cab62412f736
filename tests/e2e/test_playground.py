"""The playground at GET / in headless Chromium: a click streams text and fills TTFT and tok/s.

Needs Debian's chromium + chromium-driver (`make setup` installs them) and selenium; skipped
with the reason when they are missing. The driver is given by path, so selenium never tries to
download one.
"""

import os
import shutil

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def test_playground_page_is_served(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert 'id="send"' in r.text and "/v1/chat/completions" in r.text


@pytest.fixture
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("chromium / chromedriver not installed (make setup installs them)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-extensions",
        "--no-first-run",
        "--window-size=1000,800",
    ):
        options.add_argument(flag)
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium manager: never reach the network
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _number(driver, element_id: str) -> float | None:
    try:
        return float(driver.find_element("id", element_id).text)
    except ValueError:
        return None


@pytest.mark.parametrize("tier", ["priority", "default", "flex"])
def test_playground_streams_with_live_stats(server, browser, tier):
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(server.url + "/")
    Select(browser.find_element("id", "tier")).select_by_value(tier)
    max_tokens = browser.find_element("id", "max_tokens")
    max_tokens.clear()
    max_tokens.send_keys("24")
    browser.find_element("id", "send").click()
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_element("id", "status").text in ("done", "error"))
    assert browser.find_element("id", "status").text == "done", browser.find_element(
        "id", "output"
    ).text
    assert browser.find_element("id", "output").text.strip()  # streamed text arrived
    ttft = _number(browser, "ttft")
    tps = _number(browser, "tps")
    assert ttft is not None and ttft > 0
    assert tps is not None and tps > 0
    assert _number(browser, "ntokens") == 24  # usage count shown at the end
    assert browser.find_element("id", "served_tier").text == tier


def test_playground_shows_an_api_error(server, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    max_tokens = browser.find_element("id", "max_tokens")
    max_tokens.clear()
    max_tokens.send_keys("0")  # refused by the server with a 400 envelope
    browser.find_element("id", "send").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element("id", "status").text == "error")
    assert "400" in browser.find_element("id", "output").text
    assert browser.find_element("id", "ttft").text == "-"
    assert browser.find_element("id", "send").is_enabled()  # ready for the next try
