"""The chat page sends an image: attached from a file, shown in the user's turn, sent as an image_url
part, and the reply is the one the official `openai` client gets for the same image and text
(headless Chromium through selenium, as tests/test_chat_page.py drives the page)."""
from __future__ import annotations

import base64
import io

import openai
import pytest
from server_apps import running_server
from server_process import free_port
from test_chat_page import browser, open_page, press, set_field, type_prompt, wait_reply, wait_until  # noqa: F401

from wallbreaker import LLM
from wallbreaker.server.app import build_app

pytestmark = pytest.mark.slow  # a server thread and a headless browser
Image = pytest.importorskip("PIL.Image")
skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")


@pytest.fixture(scope="module")
def url(tiny_gemma3_vision):
    llm = LLM(tiny_gemma3_vision, dtype="float32", max_model_len=256, max_num_seqs=4)
    with running_server(build_app(llm, port=free_port())) as base:
        yield base


def test_the_page_sends_an_attached_image(browser, url, tmp_path):
    image = tmp_path / "coffee.png"
    Image.fromarray(skdata.coffee()).save(image)
    open_page(browser, url)
    for name, value in (("temperature", 0), ("max_tokens", 8), ("seed", 3)):
        set_field(browser, name, value)
    picker = browser.find_element("id", "image")
    browser.execute_script("arguments[0].hidden = false", picker)
    picker.send_keys(str(image))
    wait_until(lambda: browser.find_elements("css selector", "#attachments img.thumb"), what="the thumbnail")
    type_prompt(browser, "Describe the image.")
    press(browser, "ENTER")
    shown = wait_reply(browser)
    assert browser.find_elements("css selector", '#messages [data-role="user"] img.thumb')
    assert not browser.find_elements("css selector", "#attachments img.thumb")  # sent: the composer is clear

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    data = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    expected = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, top_p=0.95,
                                              seed=3, max_tokens=8, messages=[{"role": "user", "content": [
                                                  {"type": "image_url", "image_url": {"url": data}},
                                                  {"type": "text", "text": "Describe the image."}]}])
    other = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "Describe the image."}])
    text = expected.choices[0].message.content
    assert text != other.choices[0].message.content  # the image is read: the comparison can fail
    assert shown.strip() == text.strip()
