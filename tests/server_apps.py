"""In-process server apps over tiny models, for tests that need no subprocess."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from fastapi import FastAPI
from fastapi.testclient import TestClient

from wallbreaker import LLM, EngineConfig
from wallbreaker.text.chat_template import ChatTemplate
from wallbreaker.server.app import build_app
from wallbreaker.server.run import uvicorn_config

ERROR_FIELDS = {"message", "type", "param", "code"}


def make_app(model: Path, *, max_model_len: int = 64, max_num_seqs: int = 4, **options) -> FastAPI:
    """A float32 engine on `model` behind an app; `options` are engine options (EngineConfig's
    fields) or server settings (ServerConfig's)."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    engine = {k: v for k, v in options.items() if k in engine_fields}
    llm = LLM(model, dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs, **engine)
    return build_app(llm, **{k: v for k, v in options.items() if k not in engine_fields})


# A short template that takes tools: the tiny tokenizer spends a token on every few characters, and
# the Hermes listing that a template without tools gets (the tiny model's own) fills its context.
TOOL_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                 "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tool_app(model, **options):
    app = make_app(model, max_model_len=1024, max_num_seqs=8, **options)
    app.state.server.llm.chat_template = ChatTemplate(TOOL_TEMPLATE, None, None)
    return app


@contextmanager
def app_client(app: FastAPI) -> Iterator[TestClient]:
    """A client that runs the app's lifespan (so its engine thread stops at the end) and turns
    unexpected exceptions into 500 responses, as a real server does, instead of raising them."""
    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as client:
        yield client


def assert_openai_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str) and body["error"]["type"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


@contextmanager
def running_server(app: FastAPI) -> Iterator[str]:
    """The app behind a real uvicorn server (the settings `serve` uses) in a thread of this process,
    so a test can patch the engine; yields its base URL. The app's config must name a free port."""
    server = uvicorn.Server(uvicorn_config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    config = app.state.config
    try:
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def metrics_once(client: TestClient, *lines: str, timeout_s: float = 10.0) -> str:
    """/metrics once it shows every line: the engine thread publishes its state after its next turn
    (an abort queued by a handler that has already answered lands a moment later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.get("/metrics").text
        if all(line in text for line in lines) or time.monotonic() > deadline:
            return text
        time.sleep(0.02)
