"""The in-process app: one access line a request, and unexpected failures answered as OpenAI-shaped
500s that leave the server running."""
from __future__ import annotations

import logging

import pytest
from server_apps import app_client, assert_openai_error, make_app

COMPLETION = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}


@pytest.fixture
def app(tiny_llama):
    return make_app(tiny_llama.gguf_path)


def test_each_request_logs_one_access_line(app, caplog):
    with app_client(app) as client, caplog.at_level(logging.INFO, logger="wallbreaker.server"):
        response = client.post("/v1/completions", json=COMPLETION).json()
        client.post("/v1/completions", json={**COMPLETION, "stream": True})
        client.post("/v1/completions", json={**COMPLETION, "max_tokens": 0})
    lines = [r.getMessage() for r in caplog.records if r.name == "wallbreaker.server"]
    assert len(lines) == 3, lines
    plain, streamed, bad = lines
    prompt_tokens = response["usage"]["prompt_tokens"]
    assert plain.startswith(response["id"]) and " 200 " in plain
    assert f"prompt_tokens={prompt_tokens} completion_tokens=3 " in plain and "total=" in plain
    assert "ttft=-" not in plain
    assert streamed.startswith("cmpl-") and "completion_tokens=3" in streamed and "ttft=-" not in streamed
    assert " 400 " in bad


def test_unexpected_exception_is_a_500_in_openai_shape(app, monkeypatch):
    llm = app.state.server.llm

    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(llm, "encode", broken)
    with app_client(app) as client:
        error = assert_openai_error(client.post("/v1/completions", json=COMPLETION), 500)
        assert error["type"] == "internal_server_error" and "boom" not in error["message"]
        assert client.get("/health").status_code == 200
        assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_fails_its_requests_and_the_loop_goes_on(app, monkeypatch, stream):
    engine = app.state.server.llm.engine
    real_step = engine.step
    calls = {"n": 0}

    def step_failing_once():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real_step()
    monkeypatch.setattr(engine, "step", step_failing_once)
    with app_client(app) as client:
        response = client.post("/v1/completions", json={**COMPLETION, "stream": stream})
        if stream:
            assert response.status_code == 200
            assert '"code":"engine_error"' in response.text and response.text.endswith("data: [DONE]\n\n")
        else:
            assert assert_openai_error(response, 500)["code"] == "engine_error"
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert "wallbreaker_kv_blocks_used 0.0" in client.get("/metrics").text
