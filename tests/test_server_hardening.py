"""The server side of the hardening review: every request-borne attack gets a clear status, costs
the engine thread nothing it could not afford, and leaves other requests untouched."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_apps import app_client, assert_openai_error, make_app, running_server
from server_process import ServerProcess, free_port

from wallbreaker.engine.model_runner import ModelRunner
from wallbreaker.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

OK = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def client(tiny_llama):
    with app_client(make_app(tiny_llama.gguf_path, max_request_bytes=16384)) as c:
        yield c


def post(client, body, path="/v1/completions", headers=None):
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})


# -- stop conditions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
    ("stop", ["y" * (MAX_STOP_STRING_CHARS + 1)]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
])
def test_stop_lists_past_their_caps_are_400(client, field, value):
    assert_openai_error(post(client, {**OK, field: value}), 400, field)


def test_stop_lists_at_their_caps_are_served(client):
    body = {**OK, "stop": ["zq" * (MAX_STOP_STRING_CHARS // 2)] * MAX_STOP_STRINGS,
            "stop_token_ids": list(range(1000, 1000 + MAX_STOP_TOKEN_IDS))}
    assert post(client, body).status_code == 200


# -- /metrics and /health ------------------------------------------------------------------------
def test_metrics_and_health_are_open_by_default_even_with_an_api_key(tiny_llama):
    with app_client(make_app(tiny_llama.gguf_path, api_key="k")) as c:
        assert c.get("/metrics").status_code == 200
        assert c.get("/health").status_code == 200
        assert_openai_error(c.get("/v1/models"), 401)


def test_protect_metrics_requires_the_key_there_too(tiny_llama):
    with app_client(make_app(tiny_llama.gguf_path, api_key="k", protect_metrics=True)) as c:
        assert_openai_error(c.get("/metrics"), 401)
        assert_openai_error(c.get("/health"), 401)
        assert c.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200


def test_a_metrics_scrape_never_waits_on_the_engine_thread(tiny_llama):
    app = make_app(tiny_llama.gguf_path)
    with app_client(app) as c:
        engine = app.state.server.engine
        gate = threading.Event()
        engine._command(lambda: gate.wait(30))  # the engine thread is busy (a long step)
        answered: list[int] = []
        scraper = threading.Thread(target=lambda: answered.append(c.get("/metrics").status_code), daemon=True)
        scraper.start()
        scraper.join(10)
        gate.set()
        assert answered == [200], "/metrics waited for the engine thread"


# -- bodies and prompt sizes ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_body_past_the_limit_is_413_declared_or_chunked(client):
    big = {**OK, "prompt": "x" * 17000}
    assert_openai_error(post(client, big), 413)
    chunks = (json.dumps(big)[i:i + 1000].encode() for i in range(0, 18000, 1000))  # no Content-Length
    assert_openai_error(client.post("/v1/completions", content=chunks, headers={"Content-Type": "application/json"}),
                        413)


def test_prompt_characters_are_checked_before_tokenizing(tiny_llama, monkeypatch):
    app = make_app(tiny_llama.gguf_path)
    state = app.state.server
    calls = []
    encode = state.llm.tokenizer.encode
    monkeypatch.setattr(state.llm.tokenizer, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    with app_client(app) as c:
        huge = "a" * (state.max_prompt_chars + 1)
        assert_openai_error(post(c, {**OK, "prompt": huge}), 400, "prompt")
        assert_openai_error(post(c, {"messages": [{"role": "user", "content": huge}], "max_tokens": 2},
                                 "/v1/chat/completions"), 400, "messages")
        assert calls == []
        assert post(c, OK).status_code == 200 and calls


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_past_the_context_is_clamped_to_it_with_a_length_stop(tiny_llama, stream):
    """As llama-server and Ollama do (Claude Code asks for 32,000 tokens of any model)."""
    with app_client(make_app(tiny_llama.gguf_path, max_model_len=64)) as c:
        for path, body in (("/v1/completions", {**OK, "max_tokens": 64, "ignore_eos": True}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 10**12, "ignore_eos": True})):
            response = post(c, {**body, "stream": stream, "stream_options": {"include_usage": True}} if stream
                            else body, path)
            assert response.status_code == 200, response.text
            if stream:
                chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                          if line.startswith("data: {")]
                finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
                usage = chunks[-1]["usage"]
            else:
                finish, usage = response.json()["choices"][0]["finish_reason"], response.json()["usage"]
            assert finish == "length" and usage["prompt_tokens"] + usage["completion_tokens"] == 64


# -- Host, content type, connections ---------------------------------------------------------------
def test_a_loopback_server_answers_only_to_loopback_host_names(client):
    assert_openai_error(client.get("/health", headers={"Host": "attacker.example"}), 400)
    assert_openai_error(post(client, OK, headers={"Host": "rebind.attacker.example:8000"}), 400)
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert client.get("/health", headers={"Host": host}).status_code == 200


def test_allowed_hosts_and_a_wildcard_bind(tiny_llama):
    with app_client(make_app(tiny_llama.gguf_path, host="0.0.0.0")) as c:
        assert c.get("/health", headers={"Host": "anything.example"}).status_code == 200
    with app_client(make_app(tiny_llama.gguf_path, allowed_hosts=("api.example",))) as c:
        assert c.get("/health", headers={"Host": "api.example:443"}).status_code == 200
        assert_openai_error(c.get("/health"), 400)  # localhost is not in the list


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_json_body_is_read_whatever_its_content_type(client, content_type):
    """Ollama's and llama-server's documented `curl -d` sends a form type, or none."""
    headers = {"Content-Type": content_type} if content_type else {}
    for path in ("/v1/completions", "/v1/chat/completions", "/api/generate", "/api/chat"):
        body = OK if path == "/v1/completions" else \
            {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": False, "options": {"num_predict": 2}} \
            if path == "/api/chat" else {"model": "m", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}} \
            if path == "/api/generate" else {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        response = client.post(path, content=json.dumps(body), headers=headers)
        assert response.status_code == 200, (path, response.text)


@pytest.mark.parametrize("origin", ["http://evil.example", "https://localhost.evil.example", "null",
                                    "http://127.0.0.1.evil.example:8000"])
def test_a_page_of_another_site_is_refused(client, origin):
    response = client.post("/v1/completions", content=json.dumps(OK), headers={"Origin": origin,
                                                                               "Content-Type": "text/plain"})
    assert_openai_error(response, 403)
    assert client.post("/api/generate", content=json.dumps({"model": "m", "prompt": "Hi"}),
                       headers={"Origin": origin}).status_code == 403


def test_pages_on_localhost_the_servers_own_and_the_allowed_list_pass(tiny_llama):
    with app_client(make_app(tiny_llama.gguf_path, allowed_origins=("https://*.example.com",))) as c:
        for origin in ("http://localhost:3000", "http://127.0.0.1", "http://[::1]:8080", "https://app.example.com"):
            assert post(c, OK, headers={"Origin": origin}).status_code == 200, origin
        assert_openai_error(post(c, OK, headers={"Origin": "https://example.org"}), 403)
    with app_client(make_app(tiny_llama.gguf_path, host="0.0.0.0")) as c:  # the chat page, opened from the LAN
        own = {"Host": "192.0.2.7:8000", "Origin": "http://192.0.2.7:8000"}
        assert post(c, OK, headers=own).status_code == 200
        assert_openai_error(post(c, OK, headers={**own, "Origin": "http://192.0.2.8:8000"}), 403)


@pytest.mark.slow
def test_slow_headers_are_cut_and_connections_are_bounded(tiny_llama, tmp_path):
    server = ServerProcess(tiny_llama.gguf_path, "--header-timeout", "1", "--max-connections", "3",
                           log_path=tmp_path / "server.log")
    try:
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # never finishes its headers
        slow.settimeout(5)
        start = time.monotonic()
        assert slow.recv(1024) == b"" and time.monotonic() - start < 4  # closed by the server
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        time.sleep(0.2)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503  # at the limit
        for s in idle:
            s.close()
        time.sleep(1.5)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        server.stop()


def test_the_grammar_compile_limit_is_a_serve_flag(tiny_llama, tmp_path):
    server = ServerProcess(tiny_llama.gguf_path, "--grammar-compile-timeout", "0.0001",
                           log_path=tmp_path / "server.log")
    url = f"{server.url}/v1/completions"
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        constrained = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 4, "response_format": constrained}, timeout=30)
        assert r.status_code == 400 and "longer than 0.0001 s to compile" in r.json()["error"]["message"]
        assert httpx.post(url, json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code == 200
    finally:
        server.stop()


def test_the_api_key_can_come_from_the_environment(tiny_llama, tmp_path):
    server = ServerProcess(tiny_llama.gguf_path, log_path=tmp_path / "server.log",
                           env={"WALLBREAKER_API_KEY": "from-env"})
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        ok = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer from-env"})
        assert ok.status_code == 200
        assert "from-env" not in " ".join(server.proc.args)
    finally:
        server.stop()


# -- engine errors --------------------------------------------------------------------------------
def test_engine_errors_reach_the_client_as_a_generic_message_with_an_id(tiny_llama, monkeypatch, caplog):
    app = make_app(tiny_llama.gguf_path)
    runner = app.state.server.llm.engine.runner
    execute = ModelRunner.execute

    def failing(self, step):
        if (step.input_ids == 7).any():
            raise RuntimeError("SECRET internal detail /home/user/model.bin")
        return execute(self, step)
    monkeypatch.setattr(runner, "execute", failing.__get__(runner))
    with app_client(app) as c:
        for stream in (False, True):
            response = post(c, {"prompt": [5, 7, 9], "max_tokens": 3, "stream": stream})
            text = response.text
            assert "SECRET" not in text and "error id" in text, text
            if not stream:
                assert_openai_error(response, 500)
        assert post(c, OK).status_code == 200  # the engine goes on
    assert "SECRET internal detail" in caplog.text  # the details are in the log


def test_the_engine_loops_fallback_failure_is_generic_too(tiny_llama, monkeypatch):
    app = make_app(tiny_llama.gguf_path)
    engine = app.state.server.llm.engine
    monkeypatch.setattr(engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("SECRET step state")))
    with app_client(app) as c:
        response = post(c, OK)
        assert_openai_error(response, 500)
        assert "SECRET" not in response.text and "error id" in response.text


def test_running_server_helper_serves(tiny_llama):
    app = make_app(tiny_llama.gguf_path, port=free_port())
    with running_server(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200
