"""Anthropic's Messages API on a tiny model, through the official `anthropic` client: answers are the
chat handling's own (the same greedy text and token counts as /v1/chat/completions for the same
conversation), streamed as Anthropic's event sequence, tool_use blocks whose input fits the schema,
tool_result turns, stop sequences, count_tokens, the key by x-api-key, and bad input as 4xx errors in
Anthropic's shape while another stream goes on. (The real-model checks: test_client_apis_real_model.py.)"""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import openai
import pytest
from server_apps import running_server, tool_app
from server_process import free_port

from wallbreaker.server.anthropic_messages import BlockWriter, error_event, message_body, stop_reason
from wallbreaker.server.errors import APIError
from wallbreaker.server.responses import Usage

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The forecast", "input_schema": WEATHER}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
KEY = "test-key"
GREEDY = {"temperature": 0}  # the client no longer takes sampling settings as arguments; the API does


@pytest.fixture(scope="module")
def url(tiny_llama):
    with running_server(tool_app(tiny_llama.gguf_path, port=free_port(), api_key=KEY)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert body["error"]["message"]
    return body["error"]["message"]


def post(url: str, body: bytes | dict, path: str = "/v1/messages", **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", "x-api-key": KEY, **headers})


def test_a_message_is_the_chat_answer_to_the_same_conversation(client, chat):
    message = client.messages.create(model="default", max_tokens=12, system="Answer briefly.", messages=USER,
                                     extra_body=GREEDY)
    same = chat.chat.completions.create(model="default", max_tokens=12, extra_body=GREEDY, messages=[
        {"role": "system", "content": "Answer briefly."}, *USER])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == same.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == same.usage.prompt_tokens
    assert message.usage.output_tokens == same.usage.completion_tokens == 12


def test_system_blocks_read_as_a_system_string(client):
    as_string = client.messages.count_tokens(model="default", system="Be brief. Be kind.", messages=USER)
    as_blocks = client.messages.count_tokens(model="default", messages=USER, system=[
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": " Be kind.", "cache_control": {"type": "ephemeral"}}])
    without = client.messages.count_tokens(model="default", messages=USER)
    assert as_blocks.input_tokens > without.input_tokens
    assert abs(as_blocks.input_tokens - as_string.input_tokens) <= 1  # joined with a newline, not a space


def test_a_stream_is_the_full_event_sequence_and_assembles_to_the_answer(client):
    whole = client.messages.create(model="default", max_tokens=10, messages=USER, extra_body=GREEDY)
    kinds, text = [], ""
    with client.messages.stream(model="default", max_tokens=10, messages=USER, extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                assert event.delta.type == "text_delta"
                text += event.delta.text
        final = stream.get_final_message()
    raw = [k for k in kinds if k not in ("text",)]  # the helper adds its own "text" events
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: its full blocks come from the prefix cache


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    free = client.messages.create(model="default", max_tokens=16, messages=USER, extra_body=GREEDY).content[0].text
    stop = free[4:7]
    cut = client.messages.create(model="default", max_tokens=16, messages=USER, extra_body=GREEDY,
                                 stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == free[:free.index(stop)]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_a_forced_tool_call_is_a_tool_use_block_whose_input_fits_the_schema(client, choice):
    message = client.messages.create(model="default", max_tokens=200, messages=USER, tools=TOOLS, tool_choice=choice,
                                     extra_body=GREEDY)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    assert isinstance(block.input, dict)
    jsonschema.validate(block.input, WEATHER)


def test_a_streamed_tool_call_arrives_as_input_json_deltas(client):
    with client.messages.stream(model="default", max_tokens=200, messages=USER, tools=TOOLS, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (block,) = final.content
    assert block.type == "tool_use" and len(pieces) > 1
    assert json.loads("".join(pieces)) == block.input
    jsonschema.validate(block.input, WEATHER)


def test_a_tool_result_turn_is_the_chat_conversation_with_a_tool_message(client, url):
    call = client.messages.create(model="default", max_tokens=200, messages=USER, tools=TOOLS, extra_body=GREEDY,
                                  tool_choice={"type": "tool", "name": "get_weather"}).content[0]
    turns = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, call.model_dump()]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"},
                                          {"type": "text", "text": "And tomorrow?"}]}]
    answer = client.messages.create(model="default", max_tokens=8, messages=turns, tools=TOOLS, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content
    same = [*USER, {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
            {"role": "user", "content": "And tomorrow?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                               "parameters": WEATHER}}]
    tokens = httpx.post(f"{url}/tokenize", json={"messages": same, "tools": tools}, timeout=60,
                        headers={"authorization": f"Bearer {KEY}"}).json()["count"]
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == tokens
    assert client.messages.count_tokens(model="default", messages=turns, tools=TOOLS).input_tokens == tokens


def test_stop_reasons_map_from_the_chat_finish():
    assert stop_reason("stop", None) == ("end_turn", None)
    assert stop_reason("stop", 151645) == ("end_turn", None)  # a stop token: the end of the turn
    assert stop_reason("stop", "###") == ("stop_sequence", "###")
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("tool_calls", None) == ("tool_use", None)


def test_the_key_is_read_from_x_api_key_or_authorization(url):
    body = {"model": "default", "max_tokens": 1, "messages": USER}
    assert post(url, body).status_code == 200
    assert post(url, body, **{"x-api-key": "", "authorization": f"Bearer {KEY}"}).status_code == 200
    assert_anthropic_error(post(url, body, **{"x-api-key": "wrong"}), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="default", max_tokens=1, messages=USER)


BAD = {
    "malformed JSON": (b'{"model": "default", "max_tokens": 4, "messages": [', 400, "not valid JSON"),
    "image block": ({"model": "default", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]}, 400, "image"),
    "tool schema that does not compile": ({"model": "default", "max_tokens": 4, "messages": USER, "tools": [
        {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}],
        "tool_choice": {"type": "any"}}, 400, "nonsense"),
    "tool_result in an assistant turn": ({"model": "default", "max_tokens": 4, "messages": [
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]}, *USER]},
        400, "tool_result"),
    "prefilled answer": ({"model": "default", "max_tokens": 4, "messages": [
        *USER, {"role": "assistant", "content": "It is"}]}, 400, "prefilled"),
    "missing max_tokens": ({"model": "default", "messages": USER}, 400, "max_tokens"),
}


def test_bad_input_is_a_4xx_in_anthropic_shape_while_another_stream_goes_on(client, url):
    events: list[str] = []

    def stream() -> None:
        with client.messages.stream(model="default", max_tokens=40, messages=USER, extra_body=GREEDY) as s:
            events.extend(e.type for e in s)

    thread = threading.Thread(target=stream)
    thread.start()
    kinds = {400: "invalid_request_error", 404: "not_found_error"}
    for name, (body, status, words) in BAD.items():
        message = assert_anthropic_error(post(url, body), status, kinds[status])
        assert words in message, (name, message)
    assert_anthropic_error(post(url, {"model": "default", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, path="/v1/messages/count_tokens"), 400, "invalid_request_error")
    thread.join(120)
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events


def test_a_failure_mid_stream_is_an_anthropic_error_event():
    event = error_event(APIError(408, "the request did not finish within 1 s", type="timeout"))
    kind, data = event.strip().split("\n")
    assert kind == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "timeout_error", "message": "the request did not finish within 1 s"}}


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(line.split("\ndata: ", 1)[1]) for line in lines]


def test_reasoning_the_chat_answer_carries_becomes_a_thinking_block_first():
    """The seam for reasoning parsing: a chat answer's `reasoning_content` (where the model's reasoning
    is parsed out) is a thinking block before the text, whole or streamed."""
    message = SimpleNamespace(content="Paris.", tool_calls=None, reasoning_content="The capital is Paris.")
    answer = SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")],
                             usage=Usage.of(3, 5, 0))
    run = SimpleNamespace(chat_id="msg-1", state=SimpleNamespace(model_name="m"))
    body = message_body(run, answer, SimpleNamespace(outputs=[SimpleNamespace(stop_reason=None)]))
    assert body["content"] == [{"type": "thinking", "thinking": "The capital is Paris.", "signature": ""},
                               {"type": "text", "text": "Paris."}]
    blocks = BlockWriter()
    events = _events(blocks.thinking("The capital") + blocks.thinking(" is Paris.") + blocks.text("Paris.")
                     + blocks.close())
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
    assert events[1]["delta"] == {"type": "thinking_delta", "thinking": "The capital"}


# -- what Claude Code sends ------------------------------------------------------------------------
def count(url: str, **fields) -> int:
    response = post(url, {"model": "claude-opus-5-5", "messages": USER, **fields}, "/v1/messages/count_tokens")
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


def test_the_billing_header_block_is_left_out_of_the_prompt(url):
    system = [{"type": "text", "text": "You are a helpful agent.", "cache_control": {"type": "ephemeral"}}]
    billed = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.1.abc; cc_entrypoint=cli;"}, *system]
    other = [{"type": "text", "text": "cc_version=2.1.1.abc; cc_entrypoint=cli;"}, *system]
    assert count(url, system=billed) == count(url, system=system) < count(url, system=other)


def test_a_mid_conversation_system_message_is_the_chat_one(client, chat):
    turns = [USER[0], {"role": "system", "content": "Answer in French."}]
    message = client.messages.create(model="claude-opus-5-5", max_tokens=8, messages=turns, extra_body=GREEDY)
    same = chat.chat.completions.create(model="x", max_tokens=8, messages=turns, extra_body=GREEDY)
    assert message.content[0].text == same.choices[0].message.content


def test_deferred_tools_stay_out_of_the_list_and_a_tool_reference_loads_one(url):
    lookup = {"name": "lookup", "description": "Looks a word up", "defer_loading": True,
              "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}}}
    assert count(url, tools=[*TOOLS, lookup]) == count(url, tools=TOOLS)
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]}

    def result(content: list) -> list:
        return [*USER, call, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": content}]}]
    definition = json.dumps({"name": "lookup", "description": "Looks a word up", "parameters": lookup["input_schema"]})
    loaded = count(url, tools=[*TOOLS, lookup], messages=result([{"type": "tool_reference", "tool_name": "lookup"}]))
    assert loaded == count(url, tools=TOOLS, messages=result([{"type": "text", "text": definition}]))


def test_server_tools_and_unknown_fields_are_left_aside(url):
    body = {"model": "claude-opus-5-5", "max_tokens": 2, "messages": USER, "context_management": {"edits": []},
            "output_config": {"effort": "high"}, "thinking": {"type": "adaptive"},
            "tools": [*TOOLS, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}
    response = post(url, body)
    assert response.status_code == 200, response.text
    assert count(url, tools=body["tools"]) == count(url, tools=TOOLS)
