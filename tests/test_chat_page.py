"""The chat page at ``/`` driven in a real headless browser (Chromium and chromedriver from the OS
packages, through Selenium), against the server on tiny random Gemma 4 checkpoints with the real
tokenizer and chat template.

On a vision checkpoint: the page shows the model's name, the context use after an answer, the
thinking toggle (Gemma 4's template takes ``enable_thinking``) and the attach button; a typed
message is answered by a streamed answer equal to the same request sent without streaming
(greedy); an attached image is sent and answered as the same request with the image as a data URL;
Stop ends a long generation, the server stops generating for it, and the next message is served.
With ``--api-key`` on a scripted text-only checkpoint: the page itself opens without the key, asks
for it, says when a wrong one is refused, then works; no attach button (no tower); an answer made
of HTML markup is shown as that text, no element made of it; with thinking switched on the thought
shows apart from the answer. Every page response
carries the Content-Security-Policy. Skips, with the reason, where chromium or chromedriver is not
installed (Debian: ``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import base64
import json
import shutil
import time
import urllib.request

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")
pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver")

import models  # noqa: E402
from models.serving.page import CONTENT_SECURITY_POLICY  # noqa: E402
from tests.server_tiny import http, running_server  # noqa: E402

pytestmark = pytest.mark.slow

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if BROWSER is None or DRIVER is None:
        pytest.skip(f"needs Chromium and chromedriver (Debian: apt-get install chromium chromium-driver); "
                    f"chromium: {BROWSER}, chromedriver: {DRIVER}")  # fmt: skip
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    PAGES.append(driver)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory):
    from tests.test_gemma4_multimodal_chat import build_chat_checkpoint

    return models.load(str(build_chat_checkpoint(tmp_path_factory.mktemp("page-vision"))))


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    import numpy as np
    from PIL import Image

    path = tmp_path_factory.mktemp("page-media") / "noise.png"
    Image.fromarray((np.random.default_rng(0).random((40, 60, 3)) * 255).astype(np.uint8)).save(path)
    return path


PAGES = []  # the browser, for wait_for's check of the page's error line


def driver_error() -> str:
    return text_of(PAGES[0], "#error") if PAGES else ""


def wait_for(condition, timeout: float = 120, what: str = "the page", error_expected: bool = False):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        assert error_expected or not driver_error(), f"waiting for {what}, the page shows an error: {driver_error()}"
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def text_of(driver, selector: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector).get_property("textContent")


def send(driver, text: str, max_tokens: int) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "max-tokens")
    box.clear()
    box.send_keys(str(max_tokens))
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()


def answers(driver) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".turn.assistant")


def finished_answer(driver, count: int) -> str:
    """The content of the ``count``-th answer once its stream has ended."""
    turn = wait_for(lambda: len(answers(driver)) >= count and answers(driver)[count - 1].get_attribute("data-finish")
                    and answers(driver)[count - 1], what=f"answer {count} to finish")  # fmt: skip
    return turn.find_element("css selector", ".content").get_property("textContent")


def plain_answer(url: str, content, max_tokens: int, history: list | None = None) -> str:
    body = {"model": "tiny", "max_tokens": max_tokens, "messages": [*(history or []), {"role": "user", "content": content}],
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    status, answer = http(f"{url}/v1/chat/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["message"]["content"]


def test_page_streams_attaches_an_image_and_stops(browser, vision_model, photo):
    from selenium.webdriver.common.by import By

    with running_server(vision_model, checkpoint_sampling=False) as url:
        with urllib.request.urlopen(url + "/") as response:
            assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
            assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY
        browser.get(url + "/")
        wait_for(lambda: text_of(browser, "#model-name") == "tiny", what="the model's name")
        assert browser.find_element(By.ID, "thinking-label").is_displayed()
        assert browser.find_element(By.ID, "attach-label").is_displayed()
        assert "image/*" in browser.find_element(By.ID, "attach").get_attribute("accept")

        # Type and send: the streamed answer equals the same request answered whole.
        send(browser, "Hello there", 24)
        first = finished_answer(browser, 1)
        assert first and first == plain_answer(url, "Hello there", 24)
        used, limit = text_of(browser, "#context-use").removesuffix(" tokens").split(" / ")
        assert int(used) > 24 and int(limit) == vision_model.max_context

        # An attached image goes as a data URL in the second turn.
        browser.find_element(By.ID, "attach").send_keys(str(photo))
        send(browser, "What is this?", 12)
        second = finished_answer(browser, 2)
        data_url = "data:image/png;base64," + base64.b64encode(photo.read_bytes()).decode()
        history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first}]
        image_message = [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "What is this?"}]
        assert second == plain_answer(url, image_message, 12, history)
        assert "noise.png" in text_of(browser, ".turn.user:nth-of-type(3) .media")

        # Stop: the stream ends, the server stops generating for it and serves the next message.
        status, before = http(f"{url}/metrics")
        used = int(text_of(browser, "#context-use").split(" / ")[0])
        budget = vision_model.max_context - used - 40  # what the context holds after the conversation and the new message
        send(browser, "Tell me a long story", budget)
        wait_for(lambda: len(answers(browser)) == 3 and answers(browser)[2].find_element(By.CSS_SELECTOR, ".content")
                 .get_property("textContent"), what="the long answer to start streaming")  # fmt: skip
        assert "streaming" in answers(browser)[2].get_attribute("class")
        browser.find_element(By.ID, "stop").click()
        assert wait_for(lambda: answers(browser)[2].get_attribute("data-finish"), what="Stop") == "stopped"
        metrics = wait_for(lambda: (m := http(f"{url}/metrics")[1])["running_requests"] == 0 and m, what="the server to stop")
        generated = metrics["generated_tokens_total"] - before["generated_tokens_total"]
        time.sleep(1.0)
        assert http(f"{url}/metrics")[1]["generated_tokens_total"] - before["generated_tokens_total"] == generated
        assert generated < budget, "the stopped request ran to its limit"
        assert metrics["requests_finished"].get("cancelled", 0) >= 1, metrics
        send(browser, "Hi", 6)
        assert finished_answer(browser, 4)


HOSTILE = "<b>Paris</b> <img src=x onerror=alert(1)>"  # the answer: markup the page must show as text
THOUGHT = "The user asks about Paris"


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A scripted text-only Gemma 4 (``tests.server_tiny.save_scripted``): greedy, it answers
    ``HOSTILE``, and with thinking on thinks ``THOUGHT`` first."""
    from transformers import AutoTokenizer

    from tests.server_tiny import CHANNEL_CLOSE, CHANNEL_OPEN, NEWLINE, TURN_CLOSE, distinct, gemma4_tokenizer_dir, save_scripted, text_ids

    tokenizer = AutoTokenizer.from_pretrained(gemma4_tokenizer_dir())
    taken: set = set()
    answer = [CHANNEL_CLOSE, *distinct(tokenizer, text_ids(tokenizer, HOSTILE), taken), TURN_CLOSE]
    thought = [NEWLINE, CHANNEL_OPEN, *distinct(tokenizer, text_ids(tokenizer, "thought\n" + THOUGHT), taken), CHANNEL_CLOSE]
    return models.load(str(save_scripted(tmp_path_factory.mktemp("page-text"), [answer, thought])))


def test_page_files_are_open_and_props_need_the_key(text_model, vision_model):
    """Without a browser: the page's files (with their policy) open without the key; ``/props``
    needs it and says what the page shows."""
    from models.serving.page import page_file

    with running_server(text_model, api_key="sesame") as url:
        for path, name, kind in (("/", "index.html", "text/html"), ("/page/app.js", "app.js", "text/javascript"),
                                 ("/page/style.css", "style.css", "text/css")):  # fmt: skip
            with urllib.request.urlopen(url + path) as response:
                assert response.read() == page_file(name) and response.headers["Content-Type"].startswith(kind)
                assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
                assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert http(f"{url}/props")[0] == 401
        request = urllib.request.Request(f"{url}/props", headers={"Authorization": "Bearer sesame"})
        with urllib.request.urlopen(request) as response:
            props = json.loads(response.read())
        assert props == {"model": "tiny", "context_length": text_model.max_context, "thinking": True,
                         "modalities": {"vision": False, "audio": False}}  # fmt: skip
    with running_server(vision_model) as url:
        assert http(f"{url}/props")[1]["modalities"] == {"vision": True, "audio": False}
    script = page_file("app.js").decode()
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "eval(" not in script


def test_page_asks_for_the_api_key(browser, text_model):
    from selenium.webdriver.common.by import By

    model = text_model
    with running_server(model, checkpoint_sampling=False, api_key="sesame") as url:
        assert http(f"{url}/props")[0] == 401
        browser.get(url + "/")
        wait_for(lambda: browser.find_element(By.ID, "key-form").is_displayed(), what="the key form")
        assert text_of(browser, "#model-name") == "API key needed"
        browser.find_element(By.ID, "key-input").send_keys("wrong")
        browser.find_element(By.ID, "key-save").click()
        wait_for(lambda: "refused" in text_of(browser, "#error"), what="the refusal of a wrong key", error_expected=True)
        browser.find_element(By.ID, "key-input").send_keys("sesame")
        browser.find_element(By.ID, "key-save").click()
        wait_for(lambda: text_of(browser, "#model-name") == "tiny", what="the model's name after the key")
        assert browser.execute_script("return sessionStorage.getItem('gemma-zoo-api-key')") == "sesame"
        assert not browser.find_element(By.ID, "attach-label").is_displayed()  # no tower, no attach button
        # Model text is shown as text: the markup arrives whole and no element is made of it.
        send(browser, "Tell me about Paris", 60)
        assert finished_answer(browser, 1) == HOSTILE
        assert text_of(browser, ".turn.assistant .reasoning") == ""
        assert not browser.find_elements(By.CSS_SELECTOR, "#log b, #log img")
        # The thinking switch: the thought streams apart from the answer.
        browser.find_element(By.ID, "thinking").click()
        send(browser, "Tell me about Paris", 60)
        assert finished_answer(browser, 2) == HOSTILE
        assert answers(browser)[1].find_element(By.CSS_SELECTOR, ".reasoning").get_property("textContent") == THOUGHT
