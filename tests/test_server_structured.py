"""The server's constraints and tools on a tiny model: response_format, structured_outputs (and the
older guided_* names), logit_bias, tool calls (forced, parsed, streamed to the official client),
/tokenize and /detokenize, and no silent drops: an unknown or unsupported field, an invalid schema
and a schema that compiles past the limit are 400s naming the problem, while other streams go on."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from server_apps import app_client, assert_openai_error, make_app, running_server, tool_app
from server_process import free_port

from wallbreaker.text.chat_template import ChatTemplate
from wallbreaker.server.tool_parsers import HermesParser, Llama3JsonParser, MistralParser, parser_for
from wallbreaker.server.tools import ToolStream

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
SCHEMA = {"type": "object", "properties": {"tag": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 9}},
          "required": ["tag", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tiny_llama):
    with app_client(tool_app(tiny_llama.gguf_path)) as c:
        yield c


@pytest.fixture(scope="module")
def own_template_client(tiny_llama):
    """The tiny model's own template, which does not take tools."""
    with app_client(make_app(tiny_llama.gguf_path, max_model_len=1024)) as c:
        yield c


def chat(client, **body) -> dict:
    response = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 40, **body})
    assert response.status_code == 200, response.text
    return response.json()


# -- constraints --------------------------------------------------------------------------------
def test_structured_outputs_and_guided_names_constrain_chat_and_completions(client):
    checks = [({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
              ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
              ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
              ({"structured_outputs": {"grammar": 'root ::= "<" [xy]+ ">"'}}, lambda t: re.fullmatch(r"<[xy]+>", t)),
              ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
               lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)]
    for extra, check in checks:
        text = chat(client, temperature=1.0, seed=1, **extra)["choices"][0]["message"]["content"]
        assert check(text), (extra, text)
        answer = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40, **extra}).json()
        assert check(answer["choices"][0]["text"]), (extra, answer)


def test_response_format_json_object_and_json_schema_are_honoured(client):
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}):
        for answer in (chat(client, response_format=fmt)["choices"][0]["message"]["content"],
                       client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40, "response_format": fmt})
                       .json()["choices"][0]["text"]):
            assert answer.lstrip().startswith("{"), answer  # random weights: a JSON object, perhaps cut short
    assert chat(client, response_format={"type": "text"})["choices"][0]["finish_reason"] in ("stop", "length")


def test_logit_bias_bans_and_forces_a_token(client, tiny_llama):
    greedy = chat(client, temperature=0, max_tokens=4, logprobs=True)["choices"][0]
    first = greedy["logprobs"]["content"][0]["token"]
    token_id = client.post("/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"][0]
    banned = chat(client, temperature=0, max_tokens=4, logit_bias={str(token_id): -100})["choices"][0]
    assert not banned["message"]["content"].startswith(first)
    forced = chat(client, temperature=0.7, seed=3, max_tokens=3, logit_bias={"77": 100}, ignore_eos=True)
    assert client.post("/tokenize", json={"prompt": forced["choices"][0]["message"]["content"],
                                          "add_special_tokens": False}).json()["tokens"] == [77, 77, 77]


# -- no silent drops ----------------------------------------------------------------------------
@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/completions", {"suffix": "}"}, "suffix"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs"),
    ("/v1/completions", {"logit_bias": {"1": 200}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, None),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_unsupported_or_conflicting_fields_are_400_naming_them(client, path, extra, param):
    base = {"messages": USER} if "chat" in path else {"prompt": "Hi"}
    error = assert_openai_error(client.post(path, json={**base, "max_tokens": 4, **extra}), 400, param)
    if param in ("functions", "suffix", "best_of", "echo"):
        assert param in error["message"]


def test_bookkeeping_fields_are_accepted_and_ignored(client):
    body = {"prompt": "Hi", "max_tokens": 2, "user": "u1", "metadata": {"k": "v"}, "store": False, "best_of": 1,
            "prediction": {"type": "content", "content": "x"}, "frobnicate": 1}
    assert client.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize("constraint, words", [
    ({"structured_outputs": {"json": {"type": "integer", "minimum": "a"}}}, "minimum"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "strnig"),
    ({"structured_outputs": {"regex": "(("}}, "unclosed group"),
    ({"structured_outputs": {"grammar": 'root ::= "a" missing'}}, "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
])
def test_invalid_schema_regex_or_grammar_is_400_naming_the_problem(client, constraint, words):
    param = next(iter(constraint))
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "Hi", **constraint}), 400, param)
    assert words in error["message"]


def test_a_schema_past_the_compile_limit_and_an_invalid_one_are_400_while_four_streams_go_on(tiny_llama):
    """Grammar compilation runs off the engine thread, bounded in time; the four streams that
    run meanwhile give exactly what they give alone. The tiny model writes a hundred tokens in a
    few tens of milliseconds, faster than the two bad requests are answered, so while the streams
    run each engine step waits 3 ms more (480 steps: at least 1.4 s), and both bad requests go only
    once all four streams have sent text."""
    app = make_app(tiny_llama.gguf_path, max_model_len=512, max_num_seqs=8, port=free_port(),
                   grammar_compile_timeout=0.05)
    slow = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},9}}x{i}$"}
                                             for i in range(6400)}}
    streams = [{"prompt": p, "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
               for p in ("Hello", "The quick", "Once upon", "Numbers:")]
    with running_server(app) as url:
        alone = [_streamed_text(url, {**s, "stream": False}) for s in streams]
        engine = app.state.server.llm.engine
        step = engine.step
        engine.step = lambda: time.sleep(0.003) or step()
        results: dict[int, str] = {}
        started = [threading.Event() for _ in streams]
        threads = [threading.Thread(target=lambda i=i, s=s: results.__setitem__(i, _streamed_text(url, s, started[i])))
                   for i, s in enumerate(streams)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        too_slow = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"prompt": "Hi", "structured_outputs": {"json": slow}})
        invalid = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                             json={"messages": USER, "response_format": {
                                 "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})
        assert all(t.is_alive() for t in threads)  # the streams were still going when both answers came
        for t in threads:
            t.join(120)
    assert too_slow.status_code == 400 and "longer than 0.05 s" in too_slow.json()["error"]["message"]
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "response_format"
    assert [results[i] for i in range(4)] == alone


def _streamed_text(url: str, body: dict, started: threading.Event | None = None) -> str:
    """The text of a completion; streamed, `started` is set at its first text."""
    if not body.get("stream"):
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["text"] if chunk["choices"] else ""
                if text and started is not None:
                    started.set()
    return text


# -- tools ------------------------------------------------------------------------------------
def test_named_and_required_tool_choice_return_calls_whose_arguments_fit(client):
    named = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 temperature=0.8, seed=2, max_tokens=60)["choices"][0]
    assert named["finish_reason"] == "tool_calls" and named["message"]["content"] is None
    (call,) = named["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    required = chat(client, tools=TOOLS, tool_choice="required", temperature=0.8, seed=5, max_tokens=80)["choices"][0]
    assert required["finish_reason"] == "tool_calls" and required["message"]["tool_calls"]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in required["message"]["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])
    one = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80)["choices"][0]
    assert len(one["message"]["tool_calls"]) == 1


def test_streamed_tool_calls_assemble_in_the_official_client(tiny_llama):
    with running_server(tool_app(tiny_llama.gguf_path, port=free_port())) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            with client.chat.completions.stream(model="model", messages=USER, tools=TOOLS, tool_choice=choice,
                                                parallel_tool_calls=False, max_tokens=150, temperature=0.8,
                                                seed=4) as stream:
                final = stream.get_final_completion()
            message = final.choices[0].message
            assert final.choices[0].finish_reason == "tool_calls" and message.tool_calls
            for call in message.tool_calls:
                assert call.id and call.type == "function"
                schema = WEATHER if call.function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
                jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tools_reach_the_prompt_and_earlier_calls_and_answers_are_rendered(client, own_template_client):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    ids = own_template_client.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    prompt = own_template_client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    # the tiny model's template does not take tools: they come the Hermes way
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "The forecast" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert "<tool_response>\n18 degrees\n</tool_response>" in prompt
    ids = client.post("/tokenize", json={"messages": USER, "tools": TOOLS}).json()["tokens"]
    assert "Tools: get_weather get_time" in client.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_a_template_that_takes_tools_receives_them():
    template = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                            "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                            "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>"
                            "{% endfor %}{% endfor %}", None, None)
    assert template.supports_tools and not ChatTemplate(None, None, None).supports_tools
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}]
    assert template.render(messages, tools=TOOLS) == "[get_weather][get_time]assistant:<get_weather Oslo>"


# -- parsing the model's own calls (tool_choice "auto") -----------------------------------------
ARGS = {"city": "Paris", "unit": "celsius", "days": 2}


@pytest.mark.parametrize("parser, text, content", [
    (HermesParser(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS)
     + '}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>', "Let me check."),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(ARGS)
     + '}; {"name": "get_time", "parameters": {"zone": "utc"}}', None),
    (MistralParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(ARGS)
     + '}, {"name": "get_time", "arguments": {"zone": "utc"}}]', None),
    (MistralParser(), "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(ARGS) + '[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}',
     None),
])
def test_each_format_parses_into_calls(parser, text, content):
    got_content, calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS), ("get_time", {"zone": "utc"})]
    stream = ToolStream(parser)
    streamed = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, streamed_calls = stream.finish()
    assert (streamed + rest).strip() == (content or "") and len(streamed_calls) == 2


def test_text_without_calls_stays_content_and_a_partial_marker_is_held_back():
    parser = HermesParser()
    assert parser.parse("no calls here") == ("no calls here", [])
    assert parser.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    stream = ToolStream(parser)
    assert stream.feed("Sure <tool") == "Sure "  # "<tool" may begin a call
    assert stream.feed("s are fun") == "<tools are fun"
    assert stream.finish() == ("", [])


def test_the_parser_is_chosen_from_the_template():
    assert parser_for(ChatTemplate("{{ tools }}<tool_call>", None, None)).name == "hermes"
    assert parser_for(ChatTemplate("{{ tools }}[TOOL_CALLS]", None, None)).name == "mistral"
    assert parser_for(ChatTemplate("{{ tools }}<|start_header_id|>ipython", None, None)).name == "llama3_json"
    assert parser_for(ChatTemplate(None, None, None)).name == "hermes"  # no tools in the template: ours


def test_auto_tool_choice_parses_the_models_calls(client, monkeypatch):
    """The tiny model never writes a call by itself: its output is replaced by one, as a model would write it."""
    from wallbreaker.server import serving_chat
    from wallbreaker.server.tools import ToolPlan
    original = ToolPlan.calls_from_output
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
    monkeypatch.setattr(ToolPlan, "calls_from_output", lambda self, text: original(self, "Checking. " + call))
    answer = chat(client, tools=TOOLS, tool_choice="auto")["choices"][0]
    assert answer["message"]["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer["message"]["tool_calls"]] \
        == [("get_time", {"zone": "cet"})]
    assert answer["finish_reason"] in ("tool_calls", "length") and serving_chat


# -- /tokenize and /detokenize ----------------------------------------------------------------
def test_tokenize_and_detokenize_in_vllms_shapes(client, tiny_llama):
    out = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"] == 512
    plain = client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert plain["token_strs"] is None and out["tokens"][-len(plain["tokens"]):] == plain["tokens"]
    assert client.post("/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": "Hello world"}
    chat_ids = client.post("/tokenize", json={"messages": USER}).json()["tokens"]
    assert "What is the weather" in client.post("/detokenize", json={"tokens": chat_ids}).json()["prompt"]
    assert_openai_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
