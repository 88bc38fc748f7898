"""Every way a request can go wrong answers in OpenAI's error shape with the right status, never a 500:
bad input (400), a wrong or missing key (401), an unknown model or route (404), a full queue (429),
a request that runs out of time (408, or an error event in a stream)."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest
from server_apps import app_client, assert_openai_error, make_app, metrics_once

LONG_PROMPT = "the quick brown fox " * 40  # far beyond the 64-token context of these apps
OK_COMPLETION = {"prompt": "Hello", "max_tokens": 2}
OK_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
USER = [{"role": "user", "content": "Hi"}]

BAD_COMPLETIONS = [  # (body, param the error names)
    ("{bad json", None),
    ("[1, 2]", None),
    ("", None),
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": LONG_PROMPT}, "prompt"),
    ({"prompt": "Hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "Hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ('{"prompt": "Hi", "temperature": NaN}', "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "top_k": -2}, "top_k"),
    ({"prompt": "Hi", "min_p": 1.5}, "min_p"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "n": 1000}, "n"),
    ({"prompt": "Hi", "n": True}, "n"),
    ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "Hi", "stop": 5}, "stop"),
    ({"prompt": "Hi", "stop": [""]}, "stop"),
    ({"prompt": "Hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "Hi", "presence_penalty": 3.0}, "presence_penalty"),
    ({"prompt": "Hi", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "Hi", "seed": "x"}, "seed"),
    ({"prompt": "Hi", "seed": 2**70}, "seed"),
    ({"prompt": "Hi", "stream": "yes"}, "stream"),
    ({"prompt": "Hi", "stream_options": 1}, "stream_options"),
    ({"prompt": "Hi", "ignore_eos": "no"}, "ignore_eos"),
    ({"prompt": "Hi", "echo": True}, "echo"),
    ({"prompt": "Hi", "model": 7}, "model"),
]

BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": [{"content": "Hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "logprobs": 3}, "logprobs"),
    ({"messages": USER, "temperature": -1}, "temperature"),
]


@pytest.fixture(scope="module")
def client(tiny_llama):
    with app_client(make_app(tiny_llama.gguf_path)) as c:
        yield c


def _post(client, path: str, body) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[str(b)[:40] for b, _ in BAD_COMPLETIONS])
def test_bad_completion_is_400(client, body, param):
    assert_openai_error(_post(client, "/v1/completions", body), 400, param)


@pytest.mark.parametrize("body,param", BAD_CHATS, ids=[str(b)[:40] for b, _ in BAD_CHATS])
def test_bad_chat_is_400(client, body, param):
    assert_openai_error(_post(client, "/v1/chat/completions", body), 400, param)


@pytest.mark.parametrize("stream", [False, True])
def test_bad_request_gives_status_not_stream(client, stream):
    assert_openai_error(_post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 0, "stream": stream}), 400)


def test_unknown_fields_are_ignored_and_logged_once_by_name(client, caplog):
    caplog.set_level(logging.INFO, logger="wallbreaker.server")
    for _ in range(2):
        response = _post(client, "/v1/completions", {**OK_COMPLETION, "frobnicate": {"x": 1}, "user": "u"})
        assert response.status_code == 200, response.text
    lines = [r.getMessage() for r in caplog.records if "frobnicate" in r.getMessage()]
    assert len(lines) == 1 and "ignoring the field 'frobnicate'" in lines[0]


def test_any_model_name_is_the_one_model_served(client):
    for name in ("gpt-4", "default", "model", "claude-opus-5-5"):
        response = _post(client, "/v1/chat/completions", {**OK_CHAT, "model": name})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "model"  # the answer names the model that wrote it


def test_unknown_route_and_method_in_error_shape(client):
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get("/v1/completions"), 405)


def test_api_key_is_required_when_set(tiny_llama):
    with app_client(make_app(tiny_llama.gguf_path, api_key="sesame")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            error = assert_openai_error(c.post("/v1/completions", json=OK_COMPLETION, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert_openai_error(c.get("/v1/models"), 401)
        good = {"Authorization": "Bearer sesame"}
        assert c.post("/v1/completions", json=OK_COMPLETION, headers=good).status_code == 200
        assert c.get("/v1/models", headers=good).status_code == 200
        assert c.get("/health").status_code == 200


def test_full_queue_is_429(tiny_llama, monkeypatch):
    """One seat and one place in the queue: with two requests held in the engine, a third is refused."""
    app = make_app(tiny_llama.gguf_path, max_num_seqs=1, max_queue=1)
    engine = app.state.server.engine
    gate = threading.Event()
    real_step = engine.client.step

    def held_step():
        gate.wait(timeout=30)
        return real_step()
    monkeypatch.setattr(engine.client, "step", held_step)

    async def three() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            held = [asyncio.create_task(c.post("/v1/completions", json=OK_COMPLETION)) for _ in range(2)]
            for _ in range(500):
                if engine.queue_length == 1:
                    break
                await asyncio.sleep(0.01)
            refused = await c.post("/v1/completions", json=OK_COMPLETION)
            gate.set()
            return [refused, *await asyncio.wait_for(asyncio.gather(*held), timeout=60)]
    try:
        refused, *served = asyncio.run(three())
    finally:
        gate.set()
        engine.shutdown()
    assert assert_openai_error(refused, 429)["code"] == "queue_full"
    assert [r.status_code for r in served] == [200, 200]


def test_request_timeout_aborts_with_408_or_a_stream_error(tiny_llama, monkeypatch):
    app = make_app(tiny_llama.gguf_path, request_timeout=0.2)
    real_step = app.state.server.llm.engine.step

    def slow_step():  # 50 tokens would take a second: far past the timeout
        time.sleep(0.02)
        return real_step()
    monkeypatch.setattr(app.state.server.llm.engine, "step", slow_step)
    slow = {"prompt": "Hi", "max_tokens": 50, "ignore_eos": True}
    with app_client(app) as c:
        error = assert_openai_error(c.post("/v1/completions", json=slow), 408)
        assert error["code"] == "request_timeout"

        events = [line for line in c.post("/v1/completions", json={**slow, "stream": True}).text.splitlines() if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "request_timeout"

        expected = ("wallbreaker_kv_blocks_used 0.0", 'wallbreaker_requests_total{finish_reason="timeout"} 2.0')
        metrics = metrics_once(c, *expected)
        assert all(line in metrics for line in expected)
