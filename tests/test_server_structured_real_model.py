"""The server's structured output on a real model, the embedded SmolLM2, through the official
`openai` client: json_schema output validates for 20 seeds at temperature 0.8, streamed and not;
json_object output parses; named and required tool choice give tool_calls whose arguments fit the
parameters; logit_bias -100 bans the token greedy would choose and +100 forces one.
(test_server_structured.py has the rest, on a tiny model.)"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_apps import running_server
from server_process import free_port

from wallbreaker import LLM
from wallbreaker.server.app import build_app

pytestmark = pytest.mark.real_model

SEEDS = range(20)
# Nested objects, enums, integer bounds, string length limits, arrays with minItems and maxItems
# (benchmarks/structured_output.py measures the same schema).
PERSON = json.loads((Path(__file__).parent / "data" / "person_schema.json").read_text())
ASK_PERSON = [{"role": "user", "content": "Describe a user of a web site as JSON: name, age, role, address, tags."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now in a time zone",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"enum": ["utc", "cet", "pst"]}},
                                               "required": ["zone"], "additionalProperties": False}}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What will the weather be in Paris for the next three days?"}]


@pytest.fixture(scope="module")
def server(packaged_model):
    """SmolLM2 on the default path (dtype auto), room for 20 sequences at once."""
    llm = LLM(packaged_model("smollm2"), max_num_seqs=20, max_model_len=2048)
    with running_server(build_app(llm, port=free_port())) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def create(client: openai.OpenAI, stream: bool, **kw) -> tuple[str | None, list, str]:
    """(content, tool calls as (name, arguments), finish_reason) of one chat completion; a stream is
    assembled by the client's own helper, as an application would."""
    if not stream:
        choice = client.chat.completions.create(model="default", **kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.message.content, calls, choice.finish_reason
    with client.chat.completions.stream(model="default", **kw) as s:
        choice = s.get_final_completion().choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return choice.message.content, calls, choice.finish_reason


def many(fn, seeds) -> list:
    """`fn(seed)` for every seed at once: the requests share the engine's batches."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(fn, seeds))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_output_validates_for_20_seeds(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = many(lambda s: create(client, stream, messages=ASK_PERSON, response_format=fmt, temperature=0.8,
                                    seed=s, max_tokens=300), list(SEEDS))
    for seed, (content, calls, finish) in zip(SEEDS, answers):
        assert finish == "stop" and not calls, (seed, finish, content)
        jsonschema.validate(json.loads(content), PERSON)
    assert len({a[0] for a in answers}) > 10  # 20 seeds, not one answer 20 times


def test_json_object_output_parses(client):
    """Any object is allowed, so the prompt says which: asked for a user, a 135M model at 0.8 writes
    objects that nest on past any max_tokens."""
    ask = [{"role": "user", "content": "Reply with a JSON object with two keys, country and capital, for France."}]
    answers = many(lambda s: create(client, s % 2 == 1, messages=ask, response_format={"type": "json_object"},
                                    temperature=0.8, seed=s, max_tokens=400), list(range(10)))
    for content, _, finish in answers:
        assert finish == "stop", content
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_and_required_tool_choice_give_calls_whose_arguments_validate(client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [(choice, s) for choice in (named, "required") for s in range(5)]
    answers = many(lambda case: create(client, stream, messages=ASK_WEATHER, tools=TOOLS, tool_choice=case[0],
                                       temperature=0.8, seed=case[1], max_tokens=200), cases)
    for (choice, seed), (content, calls, finish) in zip(cases, answers):
        assert finish == "tool_calls" and calls and not content, (choice, seed, content, calls)
        if choice is named:
            assert [name for name, _ in calls] == ["get_weather"]
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_logit_bias_minus_100_bans_the_greedy_token_and_plus_100_forces_one(client, server):
    def first_token(**kw) -> tuple[str, list[str]]:
        choice = client.chat.completions.create(model="default", messages=ASK_WEATHER, temperature=0, max_tokens=5,
                                                logprobs=True, **kw).choices[0]
        return choice.message.content, [t.token for t in choice.logprobs.content]

    def token_id(text: str) -> int:
        (tid,) = httpx.post(f"{server}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        return tid
    _, greedy = first_token()
    banned_text, banned = first_token(logit_bias={str(token_id(greedy[0])): -100})
    assert banned[0] != greedy[0], (greedy, banned)
    forced_id = token_id(" banana")
    forced = client.chat.completions.create(model="default", messages=ASK_WEATHER, temperature=0.8, seed=7,
                                            max_tokens=4, logit_bias={str(forced_id): 100}, logprobs=True)
    assert [t.token for t in forced.choices[0].logprobs.content] == [" banana"] * 4
    assert forced.choices[0].message.content == " banana" * 4
