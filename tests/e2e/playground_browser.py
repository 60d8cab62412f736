"""Headless Chromium for the playground tests: the `browser` fixture (desktop size; `phone`
emulates a phone's screen) and helpers that read the page.

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
PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True}


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


def _answers(driver):
    return driver.find_elements("css selector", ".turn.assistant")


def _field(answer, name: str) -> str:
    return answer.find_element("css selector", "." + name).text


def _number(answer, name: str) -> float | None:
    try:
        return float(_field(answer, name))
    except ValueError:
        return None


def _set_number(driver, element_id: str, value: int) -> None:
    box = driver.find_element("id", element_id)
    box.clear()
    box.send_keys(str(value))


def _type_and_send(driver, text: str) -> None:
    """Types `text` (newlines as Shift+Enter) into the prompt box and sends it with Enter."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", "prompt")
    box.clear()
    box.click()
    actions = ActionChains(driver)
    for k, line in enumerate(text.split("\n")):
        if k:
            actions.key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT)
        actions.send_keys(line)
    actions.send_keys(Keys.ENTER).perform()


def _wait_state(driver, states: tuple[str, ...], timeout_s: float = 60) -> str:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout_s).until(lambda d: d.find_element("id", "status").text in states)
    return driver.find_element("id", "status").text


def _model_id(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def _wait_field(driver, answer_index: int, name: str, states: tuple[str, ...], timeout_s=60):
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout_s).until(
        lambda d: (
            len(_answers(d)) > answer_index and _field(_answers(d)[answer_index], name) in states
        )
    )
    return _field(_answers(driver)[answer_index], name)


def _conversation_items(server, conversation: str, headers: dict | None = None) -> list[dict]:
    r = httpx.get(
        f"{server.url}/v1/conversations/{conversation}/items",
        params={"order": "asc", "limit": 100},
        headers=headers or {},
    )
    r.raise_for_status()
    return r.json()["data"]


@pytest.fixture
def phone(browser):
    """The browser as a phone: 390 CSS pixels wide, mobile viewport rules (a page without a
    viewport tag is then laid out 980 pixels wide and shrunk)."""
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)
    yield browser
