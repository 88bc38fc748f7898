"""Anthropic's, Ollama's and OpenAI's Responses APIs on a real model, Qwen2.5-Coder-0.5B-Instruct, each
through its official client against one `wallbreaker serve` process: plain and streamed answers that
say what was asked, a tool call whose input fits the schema and whose result the model then uses, the
model listed and shown, and Ollama's `format` schema giving JSON that validates. (The plumbing is
tested on a tiny model: test_anthropic_messages.py, test_ollama_api.py, test_openai_responses.py.)"""
from __future__ import annotations

import json

import anthropic
from gguf import GGUFReader
import jsonschema
import ollama
import openai
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.real_model

GREEDY = {"temperature": 0}
CAPITAL = "What is the capital of France? Answer with the city's name only."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ASK_WEATHER = "What is the weather in Paris right now, in celsius?"
RESULT = "22 degrees celsius, sunny"
# With the tools withheld and this instruction the 0.5B model answers from the result in a sentence;
# with the tools in reach it calls the tool again.
USE_RESULT = "Answer the user's question in one sentence, using the tool results."


@pytest.fixture(scope="module")
def server(packaged_model, tmp_path_factory):
    """One server for the three APIs (a real model loads in seconds; CPU time is scarce)."""
    process = ServerProcess(packaged_model("qwen2.5-coder-0.5b"), "--dtype", "auto", "--max-model-len", "2048",
                            "--max-num-seqs", "4", log_path=tmp_path_factory.mktemp("server") / "server.log")
    yield process.url
    process.stop()


# -- Anthropic -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=300)


def test_anthropic_plain_and_streamed_messages(claude):
    message = claude.messages.create(model="default", max_tokens=16, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": CAPITAL}])
    assert message.stop_reason == "end_turn" and "Paris" in message.content[0].text
    kinds = []
    with claude.messages.stream(model="default", max_tokens=16, extra_body=GREEDY,
                                messages=[{"role": "user", "content": CAPITAL}]) as stream:
        kinds = [event.type for event in stream if event.type != "text"]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == message.content[0].text and final.stop_reason == "end_turn"


def test_anthropic_forced_tool_call_and_its_result(claude):
    tools = [{"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": ASK_WEATHER}]
    called = claude.messages.create(model="default", max_tokens=100, messages=ask, tools=tools, extra_body=GREEDY,
                                    tool_choice={"type": "tool", "name": "get_weather"})
    assert called.stop_reason == "tool_use"
    (use,) = [b for b in called.content if b.type == "tool_use"]
    assert isinstance(use.input, dict)
    jsonschema.validate(use.input, WEATHER)
    assert "Paris" in use.input["city"]
    answer = claude.messages.create(model="default", max_tokens=60, tools=tools, extra_body=GREEDY, system=USE_RESULT,
                                    tool_choice={"type": "none"}, messages=[
        *ask, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}])
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert answer.stop_reason == "end_turn" and "22" in text and not text.startswith("{"), text


# -- Ollama --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local(server) -> ollama.Client:
    return ollama.Client(host=server, timeout=300)


def test_ollama_chat_generate_list_and_show(local, packaged_model):
    model_path = packaged_model("qwen2.5-coder-0.5b")
    ask = [{"role": "user", "content": CAPITAL}]
    options = {**GREEDY, "num_predict": 16}
    whole = local.chat(model="default", messages=ask, stream=False, options=options)
    assert "Paris" in whole.message.content and whole.done_reason == "stop"
    assert whole.eval_count > 0 and whole.prompt_eval_count > 10 and whole.eval_duration > 0
    parts = list(local.chat(model="default", messages=ask, stream=True, options=options))
    assert "".join(p.message.content for p in parts) == whole.message.content and parts[-1].done
    generated = local.generate(model="default", prompt=CAPITAL, options=options)
    assert "Paris" in generated.response
    (model,) = local.list().models
    shown = local.show(model.model)
    assert shown.details.family == "qwen2" and shown.details.quantization_level == "Q4_K_M"
    tensors = GGUFReader(model_path).tensors
    weights = sum(int(t.n_elements) for t in tensors if not t.name.endswith(("norm.weight", ".bias")))
    assert shown.modelinfo["general.parameter_count"] == weights


def test_ollama_format_schema_gives_json_that_validates(local):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "capital": {"type": "string", "maxLength": 30},
                                               "population_millions": {"type": "number"}},
              "required": ["name", "capital", "population_millions"], "additionalProperties": False}
    answer = local.chat(model="default", stream=False, format=schema, options={**GREEDY, "num_predict": 100},
                        messages=[{"role": "user", "content": "Describe France as JSON."}])
    value = json.loads(answer.message.content)
    jsonschema.validate(value, schema)
    assert value["capital"] == "Paris"


# -- OpenAI Responses ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def test_responses_plain_and_streamed(gpt):
    response = gpt.responses.create(model="default", input=CAPITAL, max_output_tokens=16, temperature=0)
    assert response.status == "completed" and "Paris" in response.output_text
    with gpt.responses.stream(model="default", input=CAPITAL, max_output_tokens=16, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == response.output_text


def test_responses_function_tool_round_trip(gpt):
    tools = [{"type": "function", "name": "get_weather", "description": "The current weather in a city",
              "parameters": WEATHER}]
    # "required": under "auto" the 0.5B model writes its call as a Markdown JSON block, not a <tool_call>
    called = gpt.responses.create(model="default", input=ASK_WEATHER, tools=tools, tool_choice="required",
                                  max_output_tokens=100, temperature=0)
    (call,) = [item for item in called.output if item.type == "function_call"]
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert call.name == "get_weather" and "Paris" in arguments["city"]
    answer = gpt.responses.create(model="default", tools=tools, tool_choice="none", instructions=USE_RESULT,
                                  max_output_tokens=60, temperature=0, input=[
        {"role": "user", "content": ASK_WEATHER}, *[item.model_dump(exclude_none=True) for item in called.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert answer.status == "completed"
    assert "22" in answer.output_text and not answer.output_text.startswith("{"), answer.output_text
