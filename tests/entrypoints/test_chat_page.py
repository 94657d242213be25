"""The chat page at ``/`` (``chat_page.py``, ``static/``).

Without a browser: ``/`` and ``/static/{name}`` serve only the shipped files,
with their media types, reference nothing outside the server, and stay open
when an API key guards ``/v1``.

In a real headless Chromium (skipped when selenium, ``chromium`` or
``chromedriver`` is missing): over a tiny random model, the page shows a
missing API key as an error and works once the key is typed; over the real
default model with n-gram speculation (slow), a conversation streams an answer
whose tokens are coloured by source (accepted drafts among them), the figures
end as the server's stats, the server's configuration is shown, and Stop aborts
the request on the server. ``SPECSERVE_SCREENSHOT=path.png`` also saves the
real-model screenshot there (how ``docs/images/chat_page.png`` was made).
"""
from __future__ import annotations

import os
import re
import shutil

import pytest
from fastapi.testclient import TestClient

from specserve import LLM
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.chat_page import STATIC_DIR, STATIC_FILES

from server_util import running_server, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "page-test-key"
TINY = "tiny"


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})


# --------------------------------------------------------------- no browser
def test_page_and_static_files_are_served_without_the_api_key(tiny_llm):
    app = build_app(tiny_llm, TINY, api_key=KEY)
    try:
        with TestClient(app) as tc:
            r = tc.get("/")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            html = r.text
            assert '<script src="/static/chat.js"' in html and 'href="/static/chat.css"' in html
            for element_id in ("prompt", "send", "stop", "messages", "stat-tps", "stat-acceptance", "stat-tau",
                               "server-model", "server-proposer", "temperature", "top-p", "max-tokens", "api-key"):
                assert f'id="{element_id}"' in html, element_id
            assert "default-src 'self'" in r.headers["content-security-policy"]

            js = tc.get("/static/chat.js")
            assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
            assert "AbortController" in js.text and "/v1/chat/completions" in js.text and "provenance" in js.text
            css = tc.get("/static/chat.css")
            assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
            assert ".tok-accepted" in css.text and "pre-wrap" in css.text

            # Only the shipped files.
            for name in ("nope.js", "..%2Fchat_page.py", "../chat_page.py", "%2e%2e%2fapi_server.py", "chat.js.bak"):
                assert tc.get(f"/static/{name}").status_code == 404, name
            assert tc.get("/static/nope.js").json()["error"]["code"] == "not_found"

            # The page is open; /v1 still needs the key.
            assert tc.get("/static/chat.js", headers={"Authorization": "Bearer wrong"}).status_code == 200
            assert tc.get("/v1/models").status_code == 401
            assert tc.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        app.state.async_engine.shutdown()


def test_static_files_are_shipped_and_reference_nothing_elsewhere():
    """Each served file exists next to the module (pyproject ships ``static/*``) and
    names no URL with a host: the page fetches nothing from the internet."""
    for name in STATIC_FILES:
        path = STATIC_DIR / name
        assert path.is_file(), name
        text = path.read_text()
        assert not re.search(r"(https?:)?//[a-z0-9-]+(\.[a-z0-9-]+)+", text, re.I), name
        assert "url(" not in text and "@import" not in text, name


# ---------------------------------------------------------------- a browser
@pytest.fixture(scope="module")
def browser():
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("no chromium/chromedriver on PATH (apt-get install chromium chromium-driver)")
    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver's path is given: selenium never looks for (or downloads) one.
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_window_size(1280, 900)
    yield driver
    driver.quit()


def _wait(driver, condition, timeout: float):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition)


def _text(driver, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text.strip()


def _number(text: str) -> float:
    return float(text.rstrip("%").strip())


def _set(driver, element_id: str, value: str) -> None:
    """Type a value into an input and fire its change event."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)
    field.send_keys(Keys.TAB)


def _send(driver, message: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "prompt").send_keys(message)
    driver.find_element(By.ID, "send").click()


def _answer_ended(driver):
    """The last answer, once it has ended (done, failed or stopped); or False."""
    from selenium.webdriver.common.by import By

    if driver.find_element(By.ID, "error").is_displayed():
        return "error"
    done = driver.find_elements(By.CSS_SELECTOR, ".msg-assistant.done")
    return done[-1] if done else False


def _severe_console_messages(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_browser_shows_a_missing_api_key_then_streams_with_it(browser, tiny_llm):
    from selenium.webdriver.common.by import By

    app = build_app(tiny_llm, TINY, api_key=KEY)
    try:
        with running_server(app) as base:
            browser.get(base + "/")
            _wait(browser, lambda d: "API key needed" in _text(d, "server-proposer"), 20)
            _set(browser, "max-tokens", "12")
            _send(browser, "Hello there")
            _wait(browser, lambda d: d.find_element(By.ID, "error").is_displayed(), 20)
            assert "missing API key" in _text(browser, "error")
            # The failed turn is taken back: no bubbles, the text is back in the box.
            assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
            assert browser.find_element(By.ID, "prompt").get_attribute("value") == "Hello there"

            _set(browser, "api-key", KEY)
            _wait(browser, lambda d: _text(d, "server-proposer") == "ngram", 20)
            assert _text(browser, "server-model") == TINY and _text(browser, "server-k") == "3"
            assert _text(browser, "server-max-len") == "256"
            browser.find_element(By.ID, "send").click()
            answer = _wait(browser, _answer_ended, 60)
            assert answer != "error", _text(browser, "error")
            assert answer.get_attribute("data-outcome") == "done"
            assert answer.get_attribute("data-finish-reason") == "length"
            spans = answer.find_elements(By.CSS_SELECTOR, ".tok")
            assert len(spans) == 12 and all(re.search(r"\btok-(accepted|recovered|bonus|plain)\b", s.get_attribute("class"))
                                            for s in spans)
            assert _text(browser, "stat-tokens") == "12"
            assert not browser.find_element(By.ID, "error").is_displayed()
            # The only console errors: the two 401s (info and chat) before the key was typed.
            assert all("401" in m for m in _severe_console_messages(browser))
    finally:
        app.state.async_engine.shutdown()


# ------------------------------------------------- the real model (slow)
REPEAT = "Repeat this sentence twice: The quick brown fox jumps over the lazy dog."
ENDLESS = "Repeat after me, twice: specserve drafts tokens with n-grams and the model verifies them."


@pytest.fixture(scope="module")
def ngram_llm():
    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20, seed=0,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})


@pytest.mark.slow
def test_browser_conversation_colours_tokens_by_source(browser, ngram_llm, tmp_path):
    from selenium.webdriver.common.by import By

    app = build_app(ngram_llm)
    try:
        with running_server(app) as base:
            browser.get(base + "/")
            _wait(browser, lambda d: _text(d, "server-proposer") == "ngram", 30)
            assert "SmolLM2-135M" in _text(browser, "server-model")
            assert _text(browser, "server-k") == "4"
            _set(browser, "temperature", "0")
            _set(browser, "max-tokens", "64")

            _send(browser, REPEAT)
            answer = _wait(browser, _answer_ended, 120)
            assert answer != "error", _text(browser, "error")
            assert answer.get_attribute("data-outcome") == "done"
            spans = answer.find_elements(By.CSS_SELECTOR, ".tok")
            kinds = {c for s in spans for c in s.get_attribute("class").split() if c.startswith("tok-")}
            assert "tok-accepted" in kinds and kinds & {"tok-plain", "tok-recovered", "tok-bonus"}, kinds
            assert "quick brown fox" in "".join(s.get_attribute("textContent") for s in spans)

            # The figures: tokens/s from the page's clock, then the server's stats of this request.
            assert "final" in _text(browser, "stat-origin")
            assert int(_text(browser, "stat-tokens")) == len(spans)
            assert _number(_text(browser, "stat-tps")) > 0
            assert _number(_text(browser, "stat-tps-decode")) > 0
            assert 0 < _number(_text(browser, "stat-acceptance")) <= 100
            assert _number(_text(browser, "stat-tau")) > 1
            assert _text(browser, "stat-acceptance-label") == "acceptance rate"
            assert re.match(r"\d+ of \d+ draft tokens accepted", _text(browser, "stat-drafts"))
            browser.save_screenshot(str(tmp_path / "chat_page.png"))
            if os.environ.get("SPECSERVE_SCREENSHOT"):
                browser.save_screenshot(os.environ["SPECSERVE_SCREENSHOT"])

            # A second turn (the whole history is sent), stopped after its first tokens:
            # the page keeps what came, and the server aborts the request.
            _set(browser, "max-tokens", "600")
            _send(browser, ENDLESS)
            _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg-assistant")) == 2
                  and d.find_elements(By.CSS_SELECTOR, ".msg-assistant.streaming .tok"), 60)
            browser.find_element(By.ID, "stop").click()
            answer = _wait(browser, _answer_ended, 20)
            assert answer != "error", _text(browser, "error")
            assert answer.get_attribute("data-outcome") == "stopped"
            assert len(answer.find_elements(By.CSS_SELECTOR, ".tok")) < 600
            assert browser.find_element(By.ID, "send").is_enabled()
            engine = ngram_llm.engine
            assert wait_until(lambda: not engine.has_unfinished_requests(), timeout=20), "the stopped request still runs"
            assert len(browser.find_elements(By.CSS_SELECTOR, ".msg-user")) == 2
            assert not _severe_console_messages(browser)
    finally:
        app.state.async_engine.shutdown()
