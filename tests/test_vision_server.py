"""Images through every API, with the official clients (`openai`, `anthropic`, `ollama`), against the
tiny Gemma 3 vision model: the same greedy text as `LLM.chat` with the same image; and a text-only
model refusing images with a 400 that names why."""
from __future__ import annotations

import base64
import io

import anthropic
import httpx
import ollama
import openai
import pytest
from server_apps import make_app, running_server
from server_process import free_port

from wallbreaker import LLM, SamplingParams

Image = pytest.importorskip("PIL.Image")
skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
MAX_TOKENS = 8
QUESTION = "Describe the image."


def png_b64(name: str) -> str:
    buf = io.BytesIO()
    Image.fromarray(getattr(skdata, name)()).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def folder(tiny_gemma3_vision):
    return tiny_gemma3_vision


@pytest.fixture(scope="module")
def expected(folder) -> dict[str, str]:
    """LLM.chat's greedy text for each photograph, image first, then the question (with ignore_eos;
    `name + "/eos"`: without, for the APIs that have no ignore_eos)."""
    llm = LLM(folder, dtype="float32", max_model_len=256, kv_cache_memory_gb=0.05)
    out = {}
    for name in ("astronaut", "coffee"):
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(name)}},
            {"type": "text", "text": QUESTION}]}]
        for key, ignore_eos in ((name, True), (name + "/eos", False)):
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos)
            out[key] = llm.chat(messages, params)[0].outputs[0].text
    assert out["astronaut"] != out["coffee"]  # the image is read: the comparisons below can fail
    return out


@pytest.fixture(scope="module")
def url(folder):
    with running_server(make_app(folder, max_model_len=256, port=free_port())) as base:
        yield base


@pytest.mark.parametrize("name", ["astronaut", "coffee"])
def test_openai_chat_image_url(url, expected, name):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="m", temperature=0, max_tokens=MAX_TOKENS,
                                            extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
                                                {"type": "image_url", "image_url": {
                                                    "url": "data:image/png;base64," + png_b64(name), "detail": "high"}},
                                                {"type": "text", "text": QUESTION}]}])
    assert answer.choices[0].message.content == expected[name]


def test_openai_chat_streams_with_an_image(url, expected):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="m", temperature=0, max_tokens=MAX_TOKENS, stream=True,
                                            extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
                                                {"type": "image_url", "image_url": {
                                                    "url": "data:image/png;base64," + png_b64("coffee")}},
                                                {"type": "text", "text": QUESTION}]}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected["coffee"]


def test_openai_responses_input_image(url, expected):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.responses.create(model="m", max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64," + png_b64("coffee")},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == expected["coffee/eos"]


def test_anthropic_image_block(url, expected):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    message = client.messages.create(model="m", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": [
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": png_b64("astronaut")}},
                                         {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == expected["astronaut/eos"]


def test_ollama_chat_and_generate_images(url, expected):
    client = ollama.Client(host=url, timeout=120)
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    chat = client.chat(model="m", options=options,
                       messages=[{"role": "user", "content": QUESTION, "images": [png_b64("coffee")]}])
    gen = client.generate(model="m", prompt=QUESTION, images=[png_b64("astronaut")], options=options)
    assert chat.message.content == expected["coffee/eos"]
    assert gen.response == expected["astronaut/eos"]


def test_ollama_show_says_vision(url):
    assert "vision" in ollama.Client(host=url).show("m").capabilities


def test_a_decompression_bomb_and_too_many_images_are_400s_in_each_apis_shape(url):
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    bomb = base64.b64encode(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 40000, 40000, 8, 2, 0, 0, 0))
                            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")).decode()
    with pytest.raises(openai.BadRequestError, match="40000x40000|too large"):
        openai.OpenAI(base_url=f"{url}/v1", api_key="u", max_retries=0).chat.completions.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + bomb}}]}])
    with pytest.raises(anthropic.BadRequestError, match="40000x40000|too large"):
        anthropic.Anthropic(base_url=url, api_key="u", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": bomb}}]}])
    with pytest.raises(ollama.ResponseError, match="more than 16 images"):
        ollama.Client(host=url).generate(model="m", prompt="Hi", images=[png_b64("camera")] * 17)


@pytest.mark.parametrize("part, words", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "not fetched"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}, "not an image"),
])
def test_a_bad_image_is_a_400_naming_the_problem(url, part, words):
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "x"}]}]})
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_a_text_model_refuses_images_on_every_api(tiny_gemma3):
    image = png_b64("astronaut")
    with running_server(make_app(tiny_gemma3.hf_dir, max_model_len=256, port=free_port())) as base:
        openai_client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="does not take images"):
            openai_client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
                {"type": "text", "text": "Hi"}]}])
        with pytest.raises(anthropic.BadRequestError, match="does not take images"):
            anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0).messages.create(
                model="m", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}}]}])
        with pytest.raises(ollama.ResponseError, match="does not take images"):
            ollama.Client(host=base).chat(model="m", messages=[{"role": "user", "content": "Hi", "images": [image]}])
        with pytest.raises(ollama.ResponseError, match="does not take images"):
            ollama.Client(host=base).generate(model="m", prompt="Hi", images=[image])
        # text parts alone still work
        answer = openai_client.chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
        assert answer.choices[0].finish_reason in ("length", "stop")
