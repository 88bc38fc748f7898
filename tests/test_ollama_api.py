"""Ollama's API on a tiny model, through the official `ollama` client: chat and generate are the chat
and completion handling's own answers (the same greedy text and token counts as the OpenAI routes),
streamed as NDJSON, with Ollama's counters; options mapped (or refused, or ignored when they change no
output); tools; list, show, ps and version describe the model served (its size and SHA-256 from the
file, its parameter count against transformers'); bad input is a 4xx in Ollama's shape while another
stream goes on. (The real-model checks: test_client_apis_real_model.py.)"""
from __future__ import annotations

import hashlib
import json
import threading

import httpx
import ollama
import openai
import pytest
from server_apps import running_server, tool_app
from server_process import free_port

from wallbreaker.server.errors import APIError
from wallbreaker.server.ollama_api import error_line, ollama_tool_calls

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def url(tiny_llama):
    with running_server(tool_app(tiny_llama.gguf_path, port=free_port())) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> ollama.Client:
    return ollama.Client(host=url, timeout=120)


@pytest.fixture(scope="module")
def chat(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def assert_ollama_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    return body["error"]


def test_chat_is_the_chat_answer_with_ollamas_counters(client, chat):
    answer = client.chat(model="model", messages=USER, stream=False, options={**GREEDY, "num_predict": 12})
    same = chat.chat.completions.create(model="default", messages=USER, max_tokens=12, temperature=0)
    assert answer.done and answer.done_reason == "length" and answer.model == "model"
    assert answer.message.role == "assistant" and answer.message.content == same.choices[0].message.content
    assert answer.prompt_eval_count == same.usage.prompt_tokens and answer.eval_count == 12
    assert answer.load_duration == 0
    assert answer.prompt_eval_duration > 0 and answer.eval_duration > 0
    assert answer.total_duration >= answer.prompt_eval_duration + answer.eval_duration


def test_a_streamed_chat_is_ndjson_parts_that_assemble_to_the_answer(client):
    whole = client.chat(model="model:latest", messages=USER, stream=False, options={**GREEDY, "num_predict": 10})
    parts = list(client.chat(model="model:latest", messages=USER, stream=True, options={**GREEDY, "num_predict": 10}))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert len(parts) > 2
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == 10 and parts[-1].prompt_eval_count == whole.prompt_eval_count
    assert parts[-1].total_duration > 0


def test_chat_streams_by_default_as_ollama_does(url):
    with httpx.stream("POST", f"{url}/api/chat", json={"model": "model", "messages": USER,
                                                        "options": {"num_predict": 3}}, timeout=60) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])


def test_generate_renders_the_chat_template_unless_raw(client, chat):
    templated = client.generate(model="model", prompt="Hello", system="Be brief.", options={**GREEDY, "num_predict": 8})
    same = chat.chat.completions.create(model="default", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert templated.response == same.choices[0].message.content
    assert templated.prompt_eval_count == same.usage.prompt_tokens
    raw = client.generate(model="model", prompt="Hello", raw=True, options={**GREEDY, "num_predict": 8})
    plain = chat.completions.create(model="default", prompt="Hello", max_tokens=8, temperature=0)
    assert raw.response == plain.choices[0].text and raw.prompt_eval_count == plain.usage.prompt_tokens
    streamed = list(client.generate(model="model", prompt="Hello", raw=True, stream=True,
                                    options={**GREEDY, "num_predict": 8}))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done


def test_a_request_without_a_prompt_only_loads_the_model(client):
    assert client.generate(model="model").done_reason == "load"
    assert client.chat(model="model", messages=[]).done_reason == "load"
    assert client.generate(model="model", keep_alive=0).done_reason == "unload"


def openai_completion(url: str, body: dict) -> str:
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_options_map_onto_the_sampling_settings(client, url):
    free = client.generate(model="model", prompt="Hello", raw=True, options={**GREEDY, "num_predict": 16}).response
    stop = free[4:7]
    cut = client.generate(model="model", prompt="Hello", raw=True, options={**GREEDY, "num_predict": 16,
                                                                             "stop": [stop]})
    assert cut.response == free[:free.index(stop)] and cut.done_reason == "stop"
    seeded = [client.generate(model="model", prompt="Hello", raw=True,
                              options={"seed": 7, "temperature": 1.5, "num_predict": 12}).response for _ in range(2)]
    assert seeded[0] == seeded[1]
    hardware = client.generate(model="model", prompt="Hello", raw=True, options={
        **GREEDY, "num_predict": 16, "num_ctx": 4096, "num_thread": 2, "num_gpu": 0, "use_mmap": True})
    assert hardware.response == free  # options about where the model runs change nothing
    penalized = client.generate(model="model", prompt="Hello", raw=True, options={
        **GREEDY, "num_predict": 16, "repeat_penalty": 1.5, "presence_penalty": 1.0, "frequency_penalty": 1.0,
        "top_k": 5, "top_p": 0.5, "min_p": 0.1})
    assert penalized.eval_count == 16
    # llama.cpp's samplers under Ollama's option names: the completion route's own seeded answer
    renamed = {"mirostat": "mirostat_mode", "repeat_penalty": "repetition_penalty"}
    for extra in ({"typical_p": 0.5}, {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
                  {"repeat_penalty": 3.0, "repeat_last_n": 4}):
        ours = client.generate(model="model", prompt="Hello", raw=True,
                               options={"seed": 3, "temperature": 1.0, "num_predict": 12, **extra}).response
        fields = {renamed.get(k, k): v for k, v in extra.items()}
        same = openai_completion(url, {"prompt": "Hello", "seed": 3, "temperature": 1.0, "top_k": 40, "top_p": 0.9,
                                       "max_tokens": 12, **fields})
        assert ours == same, extra


def test_tools_come_back_as_calls_with_object_arguments(client, url):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    # the tiny model writes no call of its own; a Hermes call in an earlier turn is read back as one
    turns = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "18 C", "tool_name": "get_weather"}]
    answer = client.chat(model="model", messages=turns, tools=tools, stream=False, options={"num_predict": 4})
    assert answer.done and answer.message.role == "assistant"
    tokens = httpx.post(f"{url}/tokenize", timeout=60, json={"messages": [*USER, {
        "role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "content": "18 C", "name": "get_weather"}], "tools": tools}).json()["count"]
    assert answer.prompt_eval_count == tokens


def test_tags_show_ps_and_version_describe_the_model_served(client, url, tiny_llama):
    (listed,) = client.list().models
    path = tiny_llama.gguf_path
    assert listed.model == "model:latest"
    assert listed.size == path.stat().st_size
    assert listed.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert listed.details.format == "gguf" and listed.details.family == "llama"
    shown = client.show("model:latest")
    reference = sum(p.numel() for p in tiny_llama.load_hf().parameters())
    info = shown.modelinfo
    norms = (2 * info["llama.block_count"] + 1) * info["llama.embedding_length"]  # not counted by shape
    assert info["general.parameter_count"] == reference - norms
    context = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    assert info["llama.context_length"] == context and info["general.architecture"] == "llama"
    assert "tools" in shown.capabilities and "{% for m in messages %}" in shown.template
    (running,) = client.ps().models
    assert running.model == "model:latest" and running.context_length == context and running.size > listed.size // 2
    version = httpx.get(f"{url}/api/version", timeout=10).json()["version"]
    assert all(part.isdigit() for part in version.split("."))


BAD = {
    "malformed JSON": ("/api/chat", b'{"model": "model", "messages": [', 400, "not valid JSON"),
    "unsupported option": ("/api/chat", {"model": "model", "messages": USER, "options": {"penalize_newline": True}},
                           400, "penalize_newline"),
    "schema that does not compile": ("/api/chat", {"model": "model", "messages": USER, "format": {"type": "nonsense"}},
                                     400, "format"),
    "unknown role": ("/api/chat", {"model": "model", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    "images": ("/api/chat", {"model": "model", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
               400, "images"),
    "suffix without FIM tokens": ("/api/generate", {"model": "model", "prompt": "x", "suffix": "y"}, 400,
                                  "fill-in-the-middle"),
}


def test_bad_input_is_a_4xx_in_ollamas_shape_while_another_stream_goes_on(client, url):
    parts: list = []

    def stream() -> None:
        parts.extend(client.chat(model="model", messages=USER, stream=True, options={"num_predict": 40}))

    thread = threading.Thread(target=stream)
    thread.start()
    for name, (path, body, status, words) in BAD.items():
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
        assert words in assert_ollama_error(response, status), name
    with pytest.raises(ollama.ResponseError) as error:
        client.chat(model="model", messages=USER, stream=False, options={"penalize_newline": True})
    assert error.value.status_code == 400 and "penalize_newline" in error.value.error
    thread.join(120)
    assert parts[-1].done and parts[-1].eval_count == 40


def test_the_key_guards_the_ollama_routes(tiny_llama):
    with running_server(tool_app(tiny_llama.gguf_path, port=free_port(), api_key="k")) as base:
        assert_ollama_error(httpx.get(f"{base}/api/tags", timeout=10), 401)
        keyed = ollama.Client(host=base, headers={"Authorization": "Bearer k"})
        assert keyed.list().models[0].model == "model:latest"


def test_a_failure_mid_stream_is_one_more_line_the_client_raises():
    line = error_line(APIError(500, "the engine failed on this request"))
    assert line.endswith("\n") and json.loads(line) == {"error": "the engine failed on this request"}


def test_calls_go_out_as_the_clients_tool_calls_with_object_arguments():
    calls = ollama_tool_calls([("get_weather", '{"city": "Paris"}'), ("get_time", "cut short {")])
    message = ollama.Message.model_validate({"role": "assistant", "content": "", "tool_calls": calls})
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
