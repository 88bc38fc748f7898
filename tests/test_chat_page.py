"""The chat page at GET /, driven in Debian's headless Chromium through selenium.

Each server runs in this process (`running_server`), so a test can shape what the engine streams:
the tiny random-weight model decodes about a thousand tokens a second here, too fast to watch a
reply grow or to stop one mid-way, so its detokenizer is paced to one token every PACE_S; and the
hostile-reply test makes the server stream `<script>` and `<img onerror>` whatever the model says.
A streamed reply is checked against what the user would get from the API: the page shows the text
of the same seeded request made through the official `openai` client, and the figures under it are
that response's usage and timings that fit the time the reply took.

WALLBREAKER_CHAT_SCREENSHOT=PATH saves the mid-stream screenshot there (else under pytest's tmp
path); WALLBREAKER_CHAT_PAGE_MODEL=smollm2 (or any model) runs the streaming test on a real model,
unpaced (docs/chat-page.png was taken so).
"""
from __future__ import annotations

import os
import re
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from server_apps import running_server
from server_process import free_port, scrape_metrics, wait_for_metric

from wallbreaker import LLM
from wallbreaker.engine.detokenizer import IncrementalDetokenizer
from wallbreaker.server.app import build_app
from wallbreaker.server.static import CONTENT_SECURITY_POLICY

pytestmark = pytest.mark.slow  # a server thread and a headless browser per test

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_BROWSER = "apt-get install -y chromium chromium-driver"
PACE_S = 0.03  # seconds per token for the tiny model (about 33 tokens/s, a slow real model)
WAIT_S = 30.0
REAL_MODEL = os.environ.get("WALLBREAKER_CHAT_PAGE_MODEL")
API_KEY = "page-test-key"


# Servers ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def paced_engine() -> Iterator[None]:
    """Every token of the tiny model takes PACE_S (on the engine thread, as a slower model would)."""
    if REAL_MODEL:
        yield
        return
    push = IncrementalDetokenizer.push

    def paced(self: IncrementalDetokenizer, token_id: int) -> str:
        time.sleep(PACE_S)
        return push(self, token_id)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(IncrementalDetokenizer, "push", paced)
        yield


@contextmanager
def serve(model: Path | str | None, *, dtype: str = "float32", **server_options) -> Iterator[str]:
    engine_options = {k: server_options.pop(k) for k in ("speculative_method", "kv_cache_disk_dir", "kv_cache_disk_gb")
                      if k in server_options}
    llm = LLM(model, dtype=dtype, max_model_len=512 if dtype == "float32" else 2048, max_num_seqs=4,
              **engine_options)
    with running_server(build_app(llm, port=free_port(), **server_options)) as url:
        yield url


@pytest.fixture(scope="module")
def chat_server(tiny_llama) -> Iterator[str]:
    if REAL_MODEL:
        with serve(None if REAL_MODEL == "default" else REAL_MODEL, dtype="auto") as url:
            yield url
    else:
        with serve(tiny_llama.gguf_path) as url:
            yield url


# The browser -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"no browser ({', '.join(missing)} missing): install it with `{INSTALL_BROWSER}` (as root)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is missing: pip install selenium")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,943",  # an 800-pixel-high page
                 "--force-device-scale-factor=1",
                 "--lang=en-US", f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_until(condition, timeout_s: float = WAIT_S, what: str = "the condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)


def open_page(browser, url: str) -> None:
    browser.get(f"{url}/")
    wait_until(lambda: browser.find_element("id", "send").is_enabled(), what="the page to load the model")


def set_field(browser, name: str, value) -> None:
    """A settings field as a user sets it (typed, or a checkbox clicked to `value`)."""
    field = browser.find_element("id", name)
    if field.get_attribute("type") == "checkbox":
        if field.is_selected() != bool(value):
            browser.execute_script("arguments[0].closest('details').open = true", field)
            field.click()
        return
    field.clear()
    field.send_keys(str(value))


def type_prompt(browser, *lines: str) -> None:
    """The lines into the prompt box, Shift+Enter between them (a new line, not a send)."""
    from selenium.webdriver.common.keys import Keys

    prompt = browser.find_element("css selector", "textarea#prompt")
    for k, line in enumerate(lines):
        if k:
            prompt.send_keys(Keys.SHIFT, Keys.ENTER)
        prompt.send_keys(line)


def press(browser, key: str, selector: str = "textarea#prompt") -> None:
    from selenium.webdriver.common.keys import Keys

    browser.find_element("css selector", selector).send_keys(getattr(Keys, key))


def last(browser, role: str):
    return browser.find_elements("css selector", f'#messages [data-role="{role}"]')[-1]


def reply_state(browser) -> tuple[str, str]:
    """(data-state, text) of the newest assistant message, in one round trip."""
    return tuple(browser.execute_script(
        "const m = [...document.querySelectorAll('#messages [data-role=\"assistant\"]')].pop();"
        "return [m.dataset.state, m.innerText];"))


def wait_reply(browser, states=("done",)) -> str:
    state = wait_until(lambda: (s := reply_state(browser))[0] in states + ("error",) and s,
                       what=f"the reply to reach {states}")
    assert state[0] in states, f"the reply ended as {state[0]}: {state[1]!r}"
    return state[1]


def stats_of(browser):
    return browser.execute_script(
        "const m = [...document.querySelectorAll('#messages [data-role=\"assistant\"]')].pop();"
        "return m.parentElement.querySelector('.stats').innerText;")


# The stats under a reply, one span each: "TTFT 182 ms" ("1.20 s" past a second), "31.4 tok/s",
# "48 tokens" (the usage; "~48 tokens", counted chunks, where a stopped reply has none), "prompt 37", "length".
STATS = re.compile(r"TTFT\s+(?P<ttft>[\d.]+)\s*(?P<unit>ms|s)\s+(?P<rate>[\d.]+)\s*tok/s\s+(?P<approx>~?)"
                   r"(?P<tokens>\d+)\s*tokens\s+prompt\s+(?P<prompt>\d+)\s+(?P<finish>\w+)")


def api_reply(url: str, conversation: list[dict], settings: dict) -> tuple[str, str, CompletionUsage]:
    """(text, finish reason, usage) of the request the page makes for `conversation` with the
    settings in its fields, made through the official client and streamed as the page streams it.
    Its cache salt gives it a prefix cache of its own, so that it finds there what the page's request
    found: the earlier turns of its own conversation, nothing of the page's."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "system", "content": settings["system"]}, *conversation],
        temperature=settings["temperature"], top_p=settings["top_p"], seed=settings["seed"],
        max_tokens=settings["max_tokens"], stream=True, stream_options={"include_usage": True},
        extra_body={"cache_salt": "api", **({"ignore_eos": True} if settings["ignore_eos"] else {})})
    text, finish, usage = "", None, None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert usage is not None and finish is not None
    return text, finish, usage


def shown_as_reply(browser, text: str) -> str:
    """`text` as the page shows a reply: rendered by its own markdown.js into a message element
    beside the newest, and read back as the user sees it (innerText)."""
    return browser.execute_async_script(
        "const [text, done] = arguments;"
        "import('/static/markdown.js').then(({ renderMarkdown }) => {"
        "  const reply = [...document.querySelectorAll('#messages [data-role=\"assistant\"]')].pop();"
        "  const probe = reply.cloneNode(false);"
        "  probe.removeAttribute('data-role');"
        "  probe.append(renderMarkdown(text));"
        "  reply.after(probe);"
        "  const shown = probe.innerText;"
        "  probe.remove();"
        "  done(shown);"
        "}, (e) => done(`markdown.js failed: ${e}`));", text)


def assert_reply_is_the_apis(browser, url: str, conversation: list[dict], settings: dict, took_s: float) -> str:
    """The newest reply on the page is the text the API gives the same request (same messages, seed
    and sampling settings), and the stats under it are that response's usage and timings that fit in
    the `took_s` seconds the reply took to come, as the test saw it. Returns the API's text."""
    text, finish, usage = api_reply(url, conversation, settings)
    reply = last(browser, "assistant")
    shown = reply_state(browser)[1]
    assert text.strip(), "the API gave an empty reply: nothing to compare"
    assert shown == shown_as_reply(browser, text), f"the page shows {shown!r}, the API gave {text!r}"
    # And the rendering keeps every word of it (a fenced block adds its language and a copy button).
    words = iter(re.findall(r"[^\W_]+", shown))
    assert all(word in words for word in re.findall(r"[^\W_]+", text)), f"{shown!r} lost words of {text!r}"

    stats = STATS.fullmatch(" ".join(stats_of(browser).split()))
    assert stats, f"the stats do not parse: {stats_of(browser)!r}"
    assert stats["approx"] == "" and int(stats["tokens"]) == usage.completion_tokens, (stats[0], usage)
    assert int(stats["prompt"]) == usage.prompt_tokens, (stats[0], usage)
    assert stats["finish"] == finish == reply.get_attribute("data-finish-reason")
    ttft_s = float(stats["ttft"]) / (1000 if stats["unit"] == "ms" else 1)
    tokens_per_s = float(stats["rate"])
    assert ttft_s > 0 and tokens_per_s > 0, stats[0]
    decode_s = (usage.completion_tokens - 1) / tokens_per_s  # the page's time from the first text to the last
    assert ttft_s + decode_s <= took_s + 0.05, f"{stats[0]}: more than the {took_s:.2f} s the reply took"
    if not REAL_MODEL:  # each token takes PACE_S: a rate far above 1 / PACE_S is miscomputed
        assert tokens_per_s <= 2 / PACE_S, f"{stats[0]}: faster than the paced model can go"
    return text


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file, from its header."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


# Tests -----------------------------------------------------------------------------------------

def test_page_and_assets_are_served_with_a_strict_policy(chat_server):
    page = httpx.get(f"{chat_server}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    for hook in ('id="prompt"', 'id="send"', 'id="stop"', 'src="/static/app.js"', 'href="/static/style.css"'):
        assert hook in page.text
    assert "<script>" not in page.text and "style=" not in page.text  # nothing inline: the policy allows none
    head = httpx.head(f"{chat_server}/")  # how clients check that a server is up
    assert head.status_code == 200 and head.content == b"" and head.headers["content-type"].startswith("text/html")
    for name, kind in (("app.js", "text/javascript"), ("markdown.js", "text/javascript"), ("style.css", "text/css")):
        asset = httpx.get(f"{chat_server}/static/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind), name
        assert asset.headers["x-content-type-options"] == "nosniff"
    for name in ("nope.js", "..%2F__init__.py", "__init__.py", "index.html"):
        missing = httpx.get(f"{chat_server}/static/{name}")
        assert missing.status_code == 404 and set(missing.json()) == {"error"}, name


FIRST_QUESTION = ("Hi!", "What can you do?")
SECOND_QUESTION = "Write a Python function that reverses a string, and show how to call it."


def test_reply_streams_token_by_token(browser, chat_server, tmp_path):
    real = bool(REAL_MODEL)
    open_page(browser, chat_server)
    settings = {"system": "You are a concise assistant. Answer in Markdown.", "temperature": 0 if real else 0.8,
                "top_p": 0.9, "seed": 7, "max_tokens": 48,
                "ignore_eos": not real}  # the tiny model may end at once; a real one would ramble on
    for name, value in settings.items():
        set_field(browser, name, value)

    # A first question over two lines (Shift+Enter), sent with Enter.
    type_prompt(browser, *FIRST_QUESTION)
    sent = time.monotonic()
    press(browser, "ENTER")
    assert last(browser, "user").text == "\n".join(FIRST_QUESTION)
    assert browser.find_element("id", "prompt").get_attribute("value") == ""
    wait_reply(browser)
    took_s = time.monotonic() - sent
    conversation = [{"role": "user", "content": "\n".join(FIRST_QUESTION)}]
    first = assert_reply_is_the_apis(browser, chat_server, conversation, settings, took_s)

    # A second one, sampled while it streams: the text grows, and the screenshot is taken mid-stream.
    settings["max_tokens"] = 160 if real else 64  # about 2 s paced: the panel polls once a second
    set_field(browser, "max_tokens", settings["max_tokens"])
    type_prompt(browser, SECOND_QUESTION)
    sent = time.monotonic()
    browser.find_element("css selector", "button#send").click()
    screenshot = Path(os.environ.get("WALLBREAKER_CHAT_SCREENSHOT") or tmp_path / "chat-page.png")
    lengths, shot = [], False
    while (state := reply_state(browser))[0] in ("waiting", "streaming"):
        if state[0] == "streaming":
            lengths.append(len(state[1]))
        if not shot and len(state[1]) >= (200 if real else 60) and browser.find_element("id", "m-running").text == "1":
            browser.save_screenshot(str(screenshot))  # mid-stream, the live panel showing the request
            shot = True
        time.sleep(0.05)
    took_s = time.monotonic() - sent
    assert state[0] == "done", state
    growth = sorted(set(lengths))
    assert len(growth) >= 4, f"the reply did not grow while streaming: {lengths}"
    # Rendered text may lose a few characters when markup completes (a code fence's backticks), no more.
    assert all(b >= a - 8 for a, b in zip(lengths, lengths[1:])), f"the streamed text shrank: {lengths}"
    assert len(state[1]) >= growth[-1] - 8
    assert shot, "the live panel never showed the request running"
    assert png_size(screenshot) == tuple(browser.execute_script("return [window.innerWidth, window.innerHeight]"))
    assert len(browser.find_elements("css selector", '#messages [data-role="assistant"]')) == 2
    # The page sends the whole conversation, its first reply as the assistant's turn.
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": SECOND_QUESTION}]
    assert_reply_is_the_apis(browser, chat_server, conversation, settings, took_s)


def test_stop_aborts_the_request_and_frees_its_blocks(browser, chat_server):
    if REAL_MODEL:
        pytest.skip("paced tiny model only")
    open_page(browser, chat_server)
    set_field(browser, "max_tokens", 300)  # about 9 s paced
    set_field(browser, "ignore_eos", True)
    before = scrape_metrics(chat_server)
    assert before["wallbreaker_requests_running"] == 0 and before["wallbreaker_kv_blocks_used"] == 0

    for how in ("button", "escape"):
        type_prompt(browser, f"Count to a thousand ({how}).")
        press(browser, "ENTER")
        wait_until(lambda: (s := reply_state(browser))[0] != "waiting" and len(s[1]) > 20, what="the reply to start")
        assert reply_state(browser)[0] == "streaming", reply_state(browser)
        busy = scrape_metrics(chat_server)
        assert busy["wallbreaker_requests_running"] == 1 and busy["wallbreaker_kv_blocks_used"] > 0
        if how == "button":
            browser.find_element("css selector", "button#stop").click()
        else:
            press(browser, "ESCAPE")
        wait_reply(browser, ("stopped",))
        assert "stopped" in stats_of(browser)
        assert browser.find_element("id", "send").is_enabled()
        assert not browser.find_element("id", "stop").is_enabled()

        idle = wait_for_metric(chat_server, "wallbreaker_requests_running", 0)
        idle = wait_for_metric(chat_server, "wallbreaker_kv_blocks_used", 0)
        assert idle["wallbreaker_requests_running"] == 0 and idle["wallbreaker_kv_blocks_used"] == 0
    generated = idle["wallbreaker_generation_tokens_total"] - before["wallbreaker_generation_tokens_total"]
    assert 0 < generated < 300, f"{generated} tokens: the stopped requests ran on"
    aborted = idle['wallbreaker_requests_total{finish_reason="abort"}'] - \
        before['wallbreaker_requests_total{finish_reason="abort"}']
    assert aborted == 2
    # The live panel comes back to idle too.
    wait_until(lambda: browser.find_element("id", "m-running").text == "0"
               and browser.find_element("id", "m-kv").text.startswith("0 /"), what="the panel to show idle")


HOSTILE = ('<script>window.__pwned = "script"</script>\n'
           '<img src=x onerror="window.__pwned = \'img\'">\n\n'
           '**bold** and `<b>inline</b>` and [a link](javascript:window.__pwned=1) '
           '<a href="javascript:window.__pwned=2">html link</a>\n\n'
           '```html\n<script>window.__pwned = "code"</script>\n```\n')


def test_hostile_reply_renders_as_text(browser, chat_server, monkeypatch):
    if REAL_MODEL:
        pytest.skip("tiny model only")
    pieces = [HOSTILE[i:i + 5] for i in range(0, len(HOSTILE), 5)]

    def hostile_push(self: IncrementalDetokenizer, token_id: int) -> str:
        stream = self.__dict__.setdefault("_hostile", iter(pieces))
        return next(stream, "")

    monkeypatch.setattr(IncrementalDetokenizer, "push", hostile_push)
    open_page(browser, chat_server)
    set_field(browser, "max_tokens", len(pieces) + 2)
    set_field(browser, "ignore_eos", True)
    type_prompt(browser, "Say something nasty.")
    press(browser, "ENTER")
    wait_reply(browser)

    message = last(browser, "assistant")
    assert '<script>window.__pwned = "script"</script>' in message.text
    assert "<img src=x onerror=" in message.text and '<a href="javascript:' in message.text
    assert "<b>inline</b>" in message.text
    created = browser.execute_script(
        "return [...document.querySelectorAll('#messages script, #messages img, #messages b, #messages iframe,"
        " #messages [onerror], #messages [href^=\"javascript\"]')].map(e => e.outerHTML)")
    assert created == []
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
    # Markdown still renders around it: the model's text is escaped, not dropped.
    assert message.find_element("css selector", "strong").text == "bold"
    assert message.find_element("css selector", "pre code").text == '<script>window.__pwned = "code"</script>'
    assert message.find_element("css selector", "p code").text == "<b>inline</b>"
    assert message.find_elements("css selector", "a") == []
    # And were a rendering bug to let markup through, the page's policy runs no inline script.
    browser.execute_script("document.getElementById('messages').insertAdjacentHTML('beforeend',"
                           " '<img src=\"/x\" onerror=\"window.__pwned = 1\">')")
    time.sleep(0.5)
    assert browser.execute_script("return typeof window.__pwned") == "undefined"


def test_api_key_is_asked_for_once_and_kept(browser, tiny_llama):
    if REAL_MODEL:
        pytest.skip("tiny model only")
    with serve(tiny_llama.gguf_path, api_key=API_KEY) as url:
        assert httpx.get(f"{url}/").status_code == 200  # the page itself is open
        assert httpx.get(f"{url}/v1/models").status_code == 401
        browser.get(f"{url}/")
        dialog = browser.find_element("id", "api-key-dialog")
        wait_until(dialog.is_displayed, what="the API key dialog")
        assert not browser.find_element("id", "send").is_enabled()

        browser.find_element("id", "api-key").send_keys("wrong-key")
        browser.find_element("id", "api-key-save").click()
        wait_until(lambda: "refused" in browser.find_element("id", "api-key-error").text, what="the refusal")
        assert dialog.is_displayed()

        browser.find_element("id", "api-key").send_keys(API_KEY)
        press(browser, "ENTER", "#api-key")
        wait_until(lambda: browser.find_element("id", "send").is_enabled(), what="the model after the key")
        assert not dialog.is_displayed()
        assert browser.execute_script("return localStorage.getItem('wallbreaker.apiKey')") == API_KEY

        # Asked once: a reload finds the key in localStorage, and a reply comes with it.
        open_page(browser, url)
        assert not browser.find_element("id", "api-key-dialog").is_displayed()
        set_field(browser, "max_tokens", 8)
        type_prompt(browser, "Hello")
        press(browser, "ENTER")
        assert wait_reply(browser)
        wait_until(lambda: browser.find_element("id", "m-running").text == "0", what="the live panel")


def test_speculative_engine_behind_the_page(browser, tiny_llama):
    if REAL_MODEL:
        pytest.skip("tiny model only")
    with serve(tiny_llama.gguf_path, speculative_method="ngram") as url:
        open_page(browser, url)
        set_field(browser, "temperature", 0)  # greedy: the random model repeats itself, and n-grams hit
        set_field(browser, "max_tokens", 64)
        set_field(browser, "ignore_eos", True)
        type_prompt(browser, "Repeat after me: the quick brown fox.")
        press(browser, "ENTER")
        assert wait_reply(browser)
        assert last(browser, "assistant").get_attribute("data-finish-reason") == "length"
        assert "64 tokens" in stats_of(browser)
        rate = scrape_metrics(url)["wallbreaker_spec_acceptance_rate"]
        assert rate > 0
        wait_until(lambda: browser.find_element("id", "m-spec").text == f"{100 * rate:.1f}%",
                   what=f"the panel to show the acceptance rate {100 * rate:.1f}%")


def test_the_panel_shows_the_disk_tiers_hits(browser, tiny_llama, tmp_path):
    """A prompt an earlier engine wrote to the disk tier is read from there; the panel counts its blocks."""
    if REAL_MODEL:
        pytest.skip("tiny model only")
    from wallbreaker import SamplingParams
    prompt = [(5 * i) % 200 + 3 for i in range(100)]  # 6 full blocks of 16, and the last token's
    earlier = LLM(tiny_llama.gguf_path, dtype="float32", max_model_len=512, kv_cache_disk_dir=str(tmp_path),
                  kv_cache_disk_gb=0.1)
    earlier.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    earlier.shutdown()
    with serve(tiny_llama.gguf_path, kv_cache_disk_dir=str(tmp_path), kv_cache_disk_gb=0.1) as url:
        open_page(browser, url)
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        assert response.status_code == 200, response.text
        assert wait_for_metric(url, "wallbreaker_kv_disk_hits_total", 6)["wallbreaker_kv_disk_hits_total"] == 6
        wait_until(lambda: browser.find_element("id", "m-disk").text == "6 blocks", what="the panel to show 6 disk hits")
