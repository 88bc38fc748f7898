"""Acceptance for the six tool-call formats (issue 47): a tiny model folder carrying each family's
own chat template (tests/data/templates/), the conversation rendered by it (tools, an earlier call
and its result), and the model's output holding one call and two, taken from that template's own
rendering of the calls (tool_formats.py), read back by the server into the same calls: plain and
streamed, in OpenAI's chat, Anthropic's Messages, OpenAI's Responses and Ollama's chat.

The engine is scripted at the handle the handlers wait on: the output arrives in small pieces (as
tokens would), so a marker split across pieces is exercised too. That the detokenizer keeps the
markers that are special tokens is test_tool_parsers.py's."""
from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator

import pytest
from server_apps import app_client, make_app
from tool_formats import FAMILIES, ONE_CALL, TOOLS, TWO_CALLS, Family, calls_of

from wallbreaker.engine.client import EngineRequest
from wallbreaker.text.chat_template import ChatTemplate
from wallbreaker.engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from wallbreaker.server.async_engine import Finished
from wallbreaker.server.tool_parsers.deepseek import deepseek_tool_listing

PIECE = 3  # characters a streamed piece


class ScriptedHandle:
    """A request handle whose output is `text`, whatever the prompt."""

    def __init__(self, request: EngineRequest, text: str, stream: bool):
        self.request, self.text, self.stream = request, text, stream

    async def events(self, deadline: float | None = None) -> AsyncIterator:
        rid = self.request.request_id
        if self.stream:
            for i in range(0, len(self.text), PIECE):
                yield StreamDelta(rid, 0, self.text[i:i + PIECE], [1], [], [], None)
            yield StreamDelta(rid, 0, "", [], [], [], "stop")
        output = CompletionOutput(0, self.text, [1] * len(self.text), "stop")
        yield Finished(RequestOutput(rid, self.request.prompt, self.request.prompt_token_ids, [output], True))

    def abort(self, reason: str = "abort") -> None:
        pass


@pytest.fixture(scope="module")
def family_app(tiny_llama, tmp_path_factory):
    """`family_app(family)`: an app over a tiny model folder carrying that family's template, whose
    engine answers the script set on `app.script` and keeps the requests in `app.requests`."""
    apps = {}

    def get(family: Family):
        if family.name not in apps:
            folder = tmp_path_factory.mktemp(f"tiny_{family.name}")
            shutil.copytree(tiny_llama.hf_dir, folder, dirs_exist_ok=True)
            config = json.loads((folder / "tokenizer_config.json").read_text())
            config["chat_template"] = family.chat_template().source
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
            model_config = json.loads((folder / "config.json").read_text())
            model_config["max_position_embeddings"] = 4096  # the templates' tool listings are long
            (folder / "config.json").write_text(json.dumps(model_config))
            app = make_app(folder, max_model_len=4096, served_model_name="m")
            app.requests, app.script = [], ""

            def submit(requests, stream, app=app):
                app.requests.extend(requests)
                return ScriptedHandle(requests[0], app.script, stream)
            app.state.server.engine.submit = submit
            apps[family.name] = app
        return apps[family.name]
    return get


def openai_history(family: Family) -> list[dict]:
    """The family's conversation as a request sends it: arguments as JSON text."""
    out = []
    for m in family.history():
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def sse(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def chat_calls(client, family: Family, stream: bool) -> list[tuple[str, dict]]:
    body = {"model": "m", "messages": openai_history(family), "tools": TOOLS, "stream": stream}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        return calls_of(choice["message"]["tool_calls"])
    calls: dict[int, dict] = {}
    for chunk in sse(r):
        for c in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk["choices"] else ():
            slot = calls.setdefault(c["index"], {"function": {"name": "", "arguments": ""}})
            slot["function"]["name"] += c["function"].get("name") or ""
            slot["function"]["arguments"] += c["function"].get("arguments") or ""
    return calls_of([calls[i] for i in sorted(calls)])


def anthropic_calls(client, stream: bool) -> list[tuple[str, dict]]:
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    body = {"model": "m", "max_tokens": 100, "tools": tools, "stream": stream,
            "messages": [{"role": "user", "content": "Weather?"}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        return [(b["name"], b["input"]) for b in r.json()["content"] if b["type"] == "tool_use"]
    blocks: dict[int, list] = {}
    for e in sse(r):
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
            blocks[e["index"]] = [e["content_block"]["name"], ""]
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            blocks[e["index"]][1] += e["delta"]["partial_json"]
    return [(name, json.loads(args)) for name, args in (blocks[i] for i in sorted(blocks))]


def responses_calls(client, stream: bool) -> list[tuple[str, dict]]:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = client.post("/v1/responses", json={"model": "m", "input": "Weather?", "tools": tools, "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        return [(i["name"], json.loads(i["arguments"])) for i in r.json()["output"] if i["type"] == "function_call"]
    items: dict[int, list] = {}
    for e in sse(r):
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call":
            items[e["output_index"]] = [e["item"]["name"], ""]
        elif e["type"] == "response.function_call_arguments.delta":
            items[e["output_index"]][1] += e["delta"]
    return [(name, json.loads(args)) for name, args in (items[i] for i in sorted(items))]


def ollama_calls(client, stream: bool) -> list[tuple[str, dict]]:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "stream": stream}
    r = client.post("/api/chat", json=body)
    assert r.status_code == 200, r.text
    parts = [json.loads(line) for line in r.text.splitlines() if line] if stream else [r.json()]
    return [(c["function"]["name"], c["function"]["arguments"])
            for p in parts for c in p["message"].get("tool_calls") or ()]


API_CALLS = {"chat": chat_calls, "anthropic": lambda c, f, s: anthropic_calls(c, s),
             "responses": lambda c, f, s: responses_calls(c, s), "ollama": lambda c, f, s: ollama_calls(c, s)}


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))
def test_each_familys_calls_come_back_as_the_same_calls_in_every_api(family_app, family):
    app = family_app(family)
    with app_client(app) as client:
        for calls in (ONE_CALL, TWO_CALLS):
            app.script = family.output(calls)
            for api, get in API_CALLS.items():
                for stream in (False, True):
                    assert get(client, family, stream) == calls, (api, stream, app.script)


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))
def test_the_conversation_is_rendered_by_the_familys_template(family_app, family):
    """Tools, an earlier call (arguments as objects) and its result reach the template as it takes them."""
    app = family_app(family)
    app.script = "Hello."
    with app_client(app) as client:
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": openai_history(family), "tools": TOOLS})
        assert r.json()["choices"][0]["message"]["content"] == "Hello."
    prompt = app.requests[-1].prompt
    tiny = app.state.server.llm.chat_template  # the family's template with the tiny tokenizer's BOS and EOS
    expected = ChatTemplate(family.chat_template().source, tiny.bos_token, tiny.eos_token)
    history = family.history()
    if not expected.supports_tools:  # DeepSeek-V3.1's: the tools go after the system prompt, as its model card says
        history[0] = {**history[0], "content": history[0]["content"] + "\n\n" + deepseek_tool_listing(TOOLS)}
        assert "### get_weather\nDescription: The weather in a city.\n\nParameters: {" in prompt
    assert prompt == expected.render(history, add_generation_prompt=True, tools=TOOLS)
    assert "Rome" in prompt and "21 degrees" in prompt


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))
def test_a_call_that_does_not_parse_comes_back_as_text(family_app, family):
    app = family_app(family)
    broken = family.output(ONE_CALL).replace('"Paris"', '"Paris').replace("Paris\n</parameter>", "Paris")
    if family.parser == "qwen3_coder":
        broken = broken.replace("<function=get_weather>", "<function=get_weather")
    app.script = broken
    with app_client(app) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse(
            client.post("/v1/chat/completions", json={**body, "stream": True})) if c["choices"])
    assert not message.get("tool_calls")
    assert "Paris" in message["content"] and "Paris" in streamed


@pytest.mark.parametrize("output", ['```json\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, '
                                    '"metric": true}}\n```', '{"name": "get_weather", "arguments": {"city": "Paris", '
                                    '"days": 3, "metric": true}}'], ids=["fenced", "bare"])
def test_qwen25_coders_untagged_call_of_a_declared_tool_is_a_call_in_every_api(family_app, output):
    """What Qwen2.5-Coder writes in every client tried (issue 47): the call without its tags."""
    app = family_app(FAMILIES["qwen2.5"])
    app.script = output
    with app_client(app) as client:
        for api, get in API_CALLS.items():
            for stream in (False, True):
                assert get(client, FAMILIES["qwen2.5"], stream) == ONE_CALL, (api, stream)
