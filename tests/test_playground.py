"""The playground page in a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium):
type a prompt, watch the canvas redraw live, read the output; then the infill mode."""

from __future__ import annotations

import os
import shutil

import pytest

webdriver = pytest.importorskip("selenium.webdriver")


def _browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        message = "headless Chromium needs Debian's chromium and chromium-driver packages (see .ci/run)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture(scope="module")
def browser():
    b = _browser()
    yield b
    b.quit()


def _run(browser, timeout: float = 60.0) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.find_element("id", "go").click()
    WebDriverWait(browser, timeout).until(lambda b: b.find_element("id", "stats").get_attribute("data-done") == "1")


def _set(browser, element_id: str, value: str) -> None:
    el = browser.find_element("id", element_id)
    el.clear()
    el.send_keys(value)


def test_playground_streams_the_canvas_live(server, browser):
    from live_server import KEY
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    WebDriverWait(browser, 20).until(lambda b: "API key" in b.find_element("id", "model").text)
    _set(browser, "key", KEY)  # the page asks for the model list again with the key
    WebDriverWait(browser, 20).until(lambda b: b.find_element("id", "model").text == "tiny")
    _set(browser, "prompt", "Say something.")
    _set(browser, "max_tokens", "20")
    _set(browser, "steps", "4")
    # count every redraw of the canvas element: a live page redraws it once per denoising step
    browser.execute_script(
        "window.redraws = 0; new MutationObserver(() => window.redraws++)"
        ".observe(document.getElementById('canvas'), {childList: true, characterData: true, subtree: true});"
    )
    _run(browser)
    if os.environ.get("DGEMMA_SCREENSHOT"):
        browser.save_screenshot(os.environ["DGEMMA_SCREENSHOT"])
    stats = browser.find_element("id", "stats").text
    assert stats.startswith("done: "), stats
    steps = int(stats.split()[1])
    assert steps >= 2  # at least one canvas, several steps
    assert browser.execute_script("return window.redraws") >= steps  # the page showed each draft as it came
    assert browser.find_element("id", "output").text.strip() or "tokens" in stats


def test_playground_infill_and_errors(server, browser):
    from live_server import KEY

    browser.get(server.url + "/")
    browser.find_element("css selector", "input[name=mode][value=infill]").click()
    assert browser.find_element("id", "suffix").is_displayed()
    _set(browser, "key", KEY)
    _set(browser, "prompt", "def add(a, b):\n")
    _set(browser, "suffix", "\nprint(add(1, 2))")
    _set(browser, "max_tokens", "8")
    _set(browser, "steps", "3")
    _run(browser)
    out = browser.find_element("id", "output").text
    assert out.startswith("def add(a, b):") and "⟨" in out and "⟩" in out and out.endswith("print(add(1, 2))"), out
    # a wrong API key: the page shows the server's error instead of failing silently
    _set(browser, "key", "wrong")
    _run(browser)
    assert browser.find_element("css selector", "#output .error").text
