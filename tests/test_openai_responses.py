"""OpenAI's Responses API on a tiny model, through the official `openai` client: answers are the chat
handling's own (the same greedy text and token counts as /v1/chat/completions for the same
conversation), streamed as OpenAI's events that the client's own helper assembles, function calls
whose arguments fit the parameters and a function_call_output turn, text.format, the bounded store
behind previous_response_id, and bad input as 4xx errors in OpenAI's shape while another stream goes
on. (The real-model checks: test_client_apis_real_model.py.)"""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from server_apps import assert_openai_error, running_server, tool_app
from server_process import free_port

from wallbreaker.server.errors import APIError
from wallbreaker.server.openai_responses import EventWriter, error_event, input_messages, output_items

USER = "What is the weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                                "parameters": WEATHER}}]
FORCE = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def url(tiny_llama):
    with running_server(tool_app(tiny_llama.gguf_path, port=free_port())) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def prompt_tokens(url: str, messages: list[dict], tools: list | None = None) -> int:
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    return httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["count"]


def test_a_response_is_the_chat_answer_to_the_same_conversation(client):
    response = client.responses.create(model="default", input=USER, instructions="Answer briefly.",
                                       max_output_tokens=12, temperature=0)
    same = client.chat.completions.create(model="default", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": USER}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == same.choices[0].message.content
    assert response.usage.input_tokens == same.usage.prompt_tokens and response.usage.output_tokens == 12
    assert response.instructions == "Answer briefly." and response.max_output_tokens == 12


def test_a_stream_is_openais_event_sequence_and_assembles_to_the_answer(client):
    whole = client.responses.create(model="default", input=USER, max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model="default", input=USER, max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 10


def test_the_clients_stream_helper_assembles_a_completed_response(client):
    with client.responses.stream(model="default", input="Hi", max_output_tokens=200, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "pick", "schema": {
                                     "type": "object", "properties": {"ok": {"type": "boolean"}},
                                     "required": ["ok"], "additionalProperties": False}}}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed"
    assert isinstance(json.loads(final.output_text)["ok"], bool)


def test_a_function_call_round_trip(client, url):
    called = client.responses.create(model="default", input=USER, tools=TOOLS, tool_choice=FORCE,
                                     max_output_tokens=200, temperature=0)
    assert called.status == "completed"
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.id != call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    turn = [{"role": "user", "content": USER}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    answer = client.responses.create(model="default", input=turn, tools=TOOLS, max_output_tokens=6, temperature=0)
    assert answer.output and answer.output[-1].type in ("message", "function_call")
    same = [{"role": "user", "content": USER}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    assert answer.usage.input_tokens == prompt_tokens(url, same, CHAT_TOOLS)


def test_a_streamed_function_call_arrives_as_argument_deltas(client):
    with client.responses.stream(model="default", input=USER, tools=TOOLS, tool_choice=FORCE, max_output_tokens=200,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = final.output
    assert len(deltas) > 1 and "".join(deltas) == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_previous_response_id_continues_a_stored_conversation(client, url):
    first = client.responses.create(model="default", input=USER, max_output_tokens=6, temperature=0)
    second = client.responses.create(model="default", input="And tomorrow?", previous_response_id=first.id,
                                     instructions="Be brief.", max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And tomorrow?"}]
    assert second.usage.input_tokens == prompt_tokens(url, history)
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = client.responses.create(model="default", input=USER, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="default", input="x", previous_response_id=unstored.id)


def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                              {"type": "input_text", "text": "there"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\":1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": "two"}]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]


BAD = {
    "malformed JSON": (b'{"model": "default", "input": [', 400, None),
    "item without a type": ({"input": [{"call_id": "x"}]}, 400, "input"),
    "image part": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    "schema that does not compile": ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "nonsense"}}}}, 400, "text.format"),
    "tool schema that does not compile": ({"input": "x", "tool_choice": FORCE, "tools": [
        {**TOOLS[0], "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}]}, 400, "tools"),
    "server-side conversation": ({"input": "x", "conversation": "c"}, 400, "conversation"),
}


def test_bad_input_is_a_4xx_in_openais_shape_while_another_stream_goes_on(client, url):
    events: list = []

    def stream() -> None:
        events.extend(client.responses.create(model="default", input=USER, max_output_tokens=40, stream=True))

    thread = threading.Thread(target=stream)
    thread.start()
    for name, (body, status, param) in BAD.items():
        content = body if isinstance(body, bytes) else json.dumps({"model": "default", **body}).encode()
        response = httpx.post(f"{url}/v1/responses", content=content, timeout=60,
                              headers={"content-type": "application/json"})
        assert_openai_error(response, status, param)
    thread.join(120)
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")


def test_a_failure_mid_stream_is_an_error_event_the_client_raises():
    writer = EventWriter({})
    writer.event("response.created", response={})
    event = error_event(writer)(APIError(408, "too slow", type="timeout", code="request_timeout"))
    kind, data = event.strip().split("\n")
    body = json.loads(data.removeprefix("data: "))
    assert kind == "event: error" and body["type"] == "error" and body["sequence_number"] == 1
    assert body["message"] == "too slow" and body["code"] == "request_timeout"
    assert body["error"] == {"message": "too slow", "type": "timeout", "param": None, "code": "request_timeout"}


def test_reasoning_the_chat_answer_carries_becomes_a_reasoning_item_first():
    """The seam for reasoning parsing: a chat answer's `reasoning_content` is a reasoning item before
    the message, whole or streamed."""
    message = SimpleNamespace(content="Paris.", tool_calls=None, reasoning_content="The capital is Paris.")
    items = output_items(SimpleNamespace(choices=[SimpleNamespace(message=message)]), {})
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "The capital is Paris."}]
    writer = EventWriter({})
    lines = writer.reasoning("The capital") + writer.text("Paris.") + writer.close()
    kinds = [line.split("\n", 1)[0].removeprefix("event: ") for line in lines]
    assert kinds == ["response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                     "response.output_item.done", "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done"]
    assert [i["type"] for i in writer.items] == ["reasoning", "message"]


# -- what Codex sends ------------------------------------------------------------------------------
def test_a_namespaced_function_is_called_by_its_name_and_comes_back_with_its_namespace(client, url):
    group = {"type": "namespace", "name": "weather_v1", "description": "Weather tools", "tools": TOOLS}
    flat = client.responses.create(model="gpt-5-codex", input=USER, tools=TOOLS, tool_choice=FORCE, temperature=0)
    grouped = client.responses.create(model="gpt-5-codex", input=USER, temperature=0, tool_choice=FORCE,
                                      tools=[group, {"type": "web_search", "external_web_access": False}],
                                      extra_body={"client_metadata": {"session_id": "s"}, "prompt_cache_key": "k"})
    call, same = grouped.output[-1], flat.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == same.arguments
    assert call.namespace == "weather_v1" and same.namespace is None  # the field as the openai client reads it
    streamed = [e for e in client.responses.create(model="x", input=USER, temperature=0, tool_choice=FORCE,
                                                    tools=[group], stream=True)]
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert done[-1].namespace == "weather_v1" and done[-1].arguments == same.arguments


def test_custom_tool_calls_in_the_history_are_calls_with_an_input_argument():
    messages = input_messages([
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Patch it"}]},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
        {"type": "web_search_call", "id": "ws1", "status": "completed"}])
    assert messages == [
        {"role": "user", "content": "Patch it"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "apply_patch", "arguments": json.dumps({"input": "*** Begin Patch"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Done"}]


def test_the_prefix_cache_hit_is_reported_as_cached_tokens(client):
    long_input = USER + " Answer with care, in one short sentence, and name the source." * 4
    first = client.responses.create(model="x", input=long_input, max_output_tokens=2, temperature=0)
    again = client.responses.create(model="x", input=long_input, max_output_tokens=2, temperature=0)
    chat = client.chat.completions.create(model="x", max_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": long_input}])
    assert first.usage.input_tokens == again.usage.input_tokens == chat.usage.prompt_tokens
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens == again.usage.input_tokens_details.cached_tokens
