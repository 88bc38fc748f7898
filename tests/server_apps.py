"""In-process server apps over tiny models, for tests that need no subprocess."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from wallbreaker import LLM
from wallbreaker.server.app import build_app

ERROR_FIELDS = {"message", "type", "param", "code"}


def make_app(model: Path, *, max_model_len: int = 64, max_num_seqs: int = 4, **server_options) -> FastAPI:
    llm = LLM(model, dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    return build_app(llm, **server_options)


@contextmanager
def app_client(app: FastAPI) -> Iterator[TestClient]:
    """A client that runs the app's lifespan (so its engine thread stops at the end) and turns
    unexpected exceptions into 500 responses, as a real server does, instead of raising them."""
    with TestClient(app, raise_server_exceptions=False) as client:
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
