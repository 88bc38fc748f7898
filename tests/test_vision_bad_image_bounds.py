"""Issue 50's bounds on bad images, on a running `wallbreaker serve` (a subprocess, so that its
resident memory is its own): a truncated PNG, bytes that are no image, a 40000x40000 PNG of a few
hundred bytes (a decompression bomb), an SVG, a 200-frame GIF and 17 images each get a 400 in their
API's error shape within 2 s, the server's resident memory grows by less than 200 MB while each is
handled, and a text stream running meanwhile gives the same tokens as it does alone.

The bounds are the acceptance's correctness bounds, not performance targets: each refusal is a
header check or a short decode that takes milliseconds and a few MB, so 2 s and 200 MB hold with a
wide margin even on a loaded 2-core machine (the memory is sampled every 5 ms by a thread of this
process while the request is in flight). The text streams run one after another from before the
first bad request to after the last; each gives the same text as a stream alone."""
from __future__ import annotations

import base64
import io
import json
import re
import struct
import threading
import time
import zlib

import httpx
import pytest
from server_process import ServerProcess

from vision_models import photo, png

psutil = pytest.importorskip("psutil")
Image = pytest.importorskip("PIL.Image")
pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
TIME_LIMIT_S = 2.0
RSS_LIMIT = 200 * 2 ** 20


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb() -> bytes:
    """A PNG whose header announces 40000x40000 RGB pixels (4.8 GB decoded), a few hundred bytes."""
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", 40000, 40000, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(b"\0" * 40001 * 64)) + _chunk(b"IEND", b""))


def gif_frames(n: int) -> bytes:
    frames = [Image.new("RGB", (32, 32), (i % 256, 255 - i % 256, 7 * i % 256)) for i in range(n)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=10, loop=0)
    return buf.getvalue()


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"><rect width="64" height="64"/></svg>'


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def openai_body(images: list[bytes]) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(d)}} for d in images]
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [*parts, {"type": "text",
                                                                                              "text": "Hi"}]}]}


def anthropic_body(images: list[bytes]) -> dict:
    parts = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(d)}} for d in images]
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [*parts, {"type": "text",
                                                                                              "text": "Hi"}]}]}


def responses_body(images: list[bytes]) -> dict:
    parts = [{"type": "input_image", "image_url": "data:image/png;base64," + b64(d)} for d in images]
    return {"model": "m", "max_output_tokens": 2, "input": [{"role": "user", "content": [
        *parts, {"type": "input_text", "text": "Hi"}]}]}


def ollama_body(images: list[bytes]) -> dict:
    return {"model": "m", "stream": False, "messages": [{"role": "user", "content": "Hi",
                                                         "images": [b64(d) for d in images]}]}


def openai_error(body: dict) -> str:
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


def anthropic_error(body: dict) -> str:
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


def ollama_error(body: dict) -> str:
    assert isinstance(body["error"], str), body
    return body["error"]


# (case, path, body builder, error shape, what the message says: a pattern)
CASES = [
    ("truncated", "/v1/chat/completions", openai_body, openai_error, "cannot be decoded"),
    ("not_an_image", "/v1/messages", anthropic_body, anthropic_error, "not an image format"),
    ("bomb", "/v1/responses", responses_body, openai_error, "40000x40000|too large"),
    ("svg", "/api/chat", ollama_body, ollama_error, "not an image format"),
    ("gif_200_frames", "/v1/chat/completions", openai_body, openai_error, "animated"),
    ("17_images", "/api/chat", ollama_body, ollama_error, "more than 16 images"),
]


def images_for(case: str) -> list[bytes]:
    good = png(photo("coffee"))
    return {"truncated": [good[:len(good) // 2]], "not_an_image": [b"%PDF-1.4 not an image at all" * 20],
            "bomb": [bomb()], "svg": [SVG], "gif_200_frames": [gif_frames(200)], "17_images": [good] * 17}[case]


@pytest.fixture(scope="module")
def server(tiny_gemma3_vision, tmp_path_factory):
    process = ServerProcess(tiny_gemma3_vision, "--max-model-len", "256",
                            log_path=tmp_path_factory.mktemp("bounds") / "server.log")
    try:
        httpx.post(f"{process.url}/v1/chat/completions", timeout=120,  # warm: the first image request's allocations
                   json={**openai_body([png(photo("astronaut"))]), "max_tokens": 4}).raise_for_status()
        yield process
    finally:
        process.stop()


STREAM = {"model": "m", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True,
          "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]}


def stream_text(url: str) -> str:
    pieces = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=STREAM, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    return "".join(pieces)


def test_bad_images_are_fast_400s_in_bounded_memory_beside_a_text_stream(server):
    alone = stream_text(server.url)
    streamed: list[str] = []
    stop = threading.Event()

    def streams() -> None:  # one after another for as long as the bad requests go on
        while not stop.is_set():
            streamed.append(stream_text(server.url))
    stream = threading.Thread(target=streams)
    stream.start()
    proc = psutil.Process(server.proc.pid)
    for case, path, body_of, error_of, words in CASES:
        body = body_of(images_for(case))
        base = proc.memory_info().rss
        peak, done = [base], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.005)
        sampler = threading.Thread(target=sample)
        sampler.start()
        start = time.monotonic()
        try:
            response = httpx.post(server.url + path, json=body, timeout=30)
        finally:
            elapsed = time.monotonic() - start
            done.set()
            sampler.join()
        assert response.status_code == 400, (case, response.text)
        assert re.search(words, error_of(response.json())), (case, response.text)
        assert elapsed < TIME_LIMIT_S, (case, elapsed)
        assert peak[0] - base < RSS_LIMIT, (case, (peak[0] - base) / 2 ** 20)
    stop.set()
    stream.join(120)
    assert len(alone) > 0 and streamed and all(text == alone for text in streamed)
