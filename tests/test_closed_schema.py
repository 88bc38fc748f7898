"""JSON schemas closed as llama.cpp closes them (engine/closed_schema.py): a schema without
`additionalProperties` allows no undeclared key, in the grammar itself (llguidance's matcher on a
tiny tokenizer) and on SmolLM2 through a named tool_choice, 10 seeds out of 10 (issue 47's
acceptance 4: unclosed, SmolLM2 wandered into keys of its own until max_tokens)."""
from __future__ import annotations

import json

import pytest

from wallbreaker import LLM
from wallbreaker.engine.closed_schema import closed
from wallbreaker.sampling_params import StructuredOutputsParams

OPEN = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}


def test_object_schemas_with_properties_are_closed_and_the_rest_left_as_they_are():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"properties": {"y": {}}}},
        "c": {"anyOf": [{"properties": {"z": {}}}, {"type": "string"}]},
        "d": {"type": "object"},
        "e": {"properties": {"w": {}}, "additionalProperties": True},
        "f": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {"properties": {"r": {}}}}}]}},
        "$defs": {"g": {"properties": {"v": {}}}}}
    out = closed(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False and props["a"]["additionalProperties"] is False
    assert props["b"]["items"]["additionalProperties"] is False
    assert props["c"]["anyOf"][0]["additionalProperties"] is False and props["c"]["anyOf"][1] == {"type": "string"}
    assert props["d"] == {"type": "object"}  # no properties: any object, as llama.cpp reads it
    assert props["e"]["additionalProperties"] is True
    # allOf members are intersected: each closed on its own keys would forbid its sibling's
    assert "additionalProperties" not in props["f"] and "additionalProperties" not in props["f"]["allOf"][0]
    assert props["f"]["allOf"][1]["properties"]["q"]["additionalProperties"] is False
    assert out["$defs"]["g"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left alone


@pytest.mark.parametrize("schema, extra_allowed", [(OPEN, False), ({**OPEN, "additionalProperties": True}, True)])
def test_the_grammar_refuses_an_undeclared_key_unless_the_schema_allows_it(tiny_llama, schema, extra_allowed):
    llm = LLM(tiny_llama.gguf_path, dtype="float32", max_model_len=64)
    grammar = llm.engine.compile_grammar(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    matcher = grammar.matcher()
    tokens = llm.tokenizer.encode('{"city":"Oslo","type":"x"}', add_special_tokens=False)
    accepted = matcher.valid_prefix(tokens)
    text_accepted = llm.tokenizer.decode(tokens[:accepted], skip_special_tokens=False)
    if extra_allowed:
        assert accepted == len(tokens), text_accepted
    else:
        assert '"type"' not in text_accepted and text_accepted.startswith('{"city":"Oslo"'), text_accepted


@pytest.mark.real_model
def test_a_named_tool_choice_on_smollm2_writes_only_declared_keys_for_ten_seeds(packaged_model):
    from wallbreaker.server.app import build_app
    from fastapi.testclient import TestClient

    llm = LLM(packaged_model("smollm2"), max_num_seqs=10, max_model_len=1024)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"},
                                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                 "required": ["city", "unit"]}}}
    body = {"model": "default", "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "temperature": 1.0, "max_tokens": 120}
    with TestClient(build_app(llm), base_url="http://localhost") as client:
        for seed in range(10):
            answer = client.post("/v1/chat/completions", json={**body, "seed": seed}).json()
            (call,) = answer["choices"][0]["message"]["tool_calls"]
            args = json.loads(call["function"]["arguments"])
            assert set(args) <= {"city", "unit"}, (seed, args)
            assert answer["choices"][0]["finish_reason"] == "tool_calls", (seed, answer)
