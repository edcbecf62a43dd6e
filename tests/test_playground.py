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


def _live_run(browser, mode: str, prompt: str, suffix: str = "", max_tokens: str = "20") -> tuple[int, str]:
    """Run one generation in `mode`; check that the canvas was redrawn live, step by step, and the
    statistics shown; returns (steps, output text)."""
    browser.find_element("css selector", f"input[name=mode][value={mode}]").click()
    assert browser.find_element("id", "suffix").is_displayed() == (mode == "infill")
    _set(browser, "prompt", prompt)
    if mode == "infill":
        _set(browser, "suffix", suffix)
    _set(browser, "max_tokens", max_tokens)
    _set(browser, "steps", "4")
    # the times at which the canvas changed: a live page changes it while the answer is streaming
    browser.execute_script(
        "window.changes = []; new MutationObserver(() => window.changes.push(performance.now()))"
        ".observe(document.getElementById('canvas'), {childList: true, characterData: true, subtree: true});"
    )
    _run(browser)
    stats = browser.find_element("id", "stats").text
    assert stats.startswith("done: ") and "? tokens" not in stats, (mode, stats)
    steps = int(stats.split()[1])
    assert steps >= 2, (mode, stats)  # several denoising steps were shown
    assert int(browser.find_element("id", "canvas").get_attribute("data-draws")) == steps  # one draw per draft
    assert len(browser.execute_script("return window.changes")) >= 2, mode  # drawn as they came, not once at the end
    assert browser.find_element("id", "canvas").text.strip(), mode
    # each token coloured by the step it last changed: steps of this canvas, the last draft's tokens
    marks = browser.execute_script("return [...document.querySelectorAll('#canvas span')].map((s) => +s.dataset.step)")
    assert marks and all(1 <= m <= 4 for m in marks), (mode, marks)
    return steps, browser.find_element("id", "output").text


def test_playground_shows_the_live_canvas_in_every_mode(server, browser):
    from live_server import KEY
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    assert browser.find_element("css selector", "input[name=mode]:checked").get_attribute("value") == "complete"
    assert browser.find_element("id", "prompt").get_attribute("value").startswith("def ")  # code, for the code model
    WebDriverWait(browser, 20).until(lambda b: "API key" in b.find_element("id", "model").text)
    _set(browser, "key", KEY)  # the page asks for the model list again with the key
    WebDriverWait(browser, 20).until(lambda b: b.find_element("id", "model").text == "tiny")
    listed = "return [...document.querySelectorAll('#routes li')].map((li) => li.textContent)"
    WebDriverWait(browser, 20).until(lambda b: len(b.execute_script(listed)) > 10)
    routes = browser.execute_script(listed)
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/api/chat", "/api/generate", "/infill"):
        assert any(f" {path}:" in route for route in routes), (path, routes)  # every dialect's routes are listed
    if os.environ.get("DGEMMA_SCREENSHOT"):
        browser.save_screenshot(os.environ["DGEMMA_SCREENSHOT"])
    _live_run(browser, "complete", "def f(x):\n")
    _live_run(browser, "chat", "Say something.")
    _, out = _live_run(browser, "infill", "def add(a, b):\n", "\nprint(add(1, 2))", max_tokens="4")
    assert out.startswith("def add(a, b):") and "⟨" in out and "⟩" in out and out.endswith("print(add(1, 2))"), out
    _live_run(browser, "complete", "x = ", max_tokens="")  # an empty box means the server's default length


def test_playground_shows_errors(server, browser):
    browser.get(server.url + "/")
    _set(browser, "key", "wrong")  # a wrong API key: the page shows the server's error instead of failing silently
    _run(browser)
    assert browser.find_element("css selector", "#output .error").text


def _png_base64() -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (96, 64), (30, 120, 200)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


GIVE_IMAGE = """
const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
const file = new File([bytes], 'picture.png', {type: 'image/png'});
const data = new DataTransfer(); data.items.add(file);
if (arguments[1] === 'drop') {
  document.getElementById('image-box').dispatchEvent(new DragEvent('drop', {dataTransfer: data, bubbles: true}));
} else {
  document.getElementById('prompt').dispatchEvent(new ClipboardEvent('paste', {clipboardData: data, bubbles: true}));
}
"""


@pytest.mark.parametrize("how", ["drop", "paste"])
def test_playground_sends_a_dropped_or_pasted_image(vision_server, browser, how):
    """Chat mode: an image dropped on the page (or pasted) goes to the server as a data: URL: the answer's
    prompt counts the image's soft tokens, and removing it sends text alone again."""
    from live_server import KEY
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(vision_server.url + "/")
    _set(browser, "key", KEY)
    browser.find_element("css selector", "input[name=mode][value=chat]").click()
    assert browser.find_element("id", "image-box").is_displayed()
    _set(browser, "prompt", "What colour is it?")
    _set(browser, "max_tokens", "4")
    _set(browser, "steps", "2")
    _run(browser)
    text_only = int(browser.find_element("id", "stats").get_attribute("data-prompt-tokens"))
    browser.execute_script(GIVE_IMAGE, _png_base64(), how)
    WebDriverWait(browser, 10).until(lambda b: b.find_element("id", "thumb").is_displayed())
    _run(browser)
    stats = browser.find_element("id", "stats")
    assert stats.text.startswith("done: "), stats.text
    with_image = int(stats.get_attribute("data-prompt-tokens"))
    from dgemma.images import target_size

    h, w = target_size(64, 96, 280)
    soft = (h // 48) * (w // 48)  # the image's soft tokens at the default budget
    # plus begin and end of image; the text beside the image may split into one token more or fewer
    assert soft + 1 <= with_image - text_only <= soft + 3, (with_image, text_only, soft)
    browser.find_element("id", "no-image").click()
    _run(browser)
    assert int(browser.find_element("id", "stats").get_attribute("data-prompt-tokens")) == text_only
