"""Random JSON bodies never get a 500 and never take the server down."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_apps import ERROR_FIELDS, app_client, make_app

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
token_ids = st.lists(st.integers(min_value=0, max_value=511), min_size=1, max_size=6)


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` nine times in ten: with twenty optional fields, a body still often gets through whole."""
    return st.integers(0, 9).flatmap(lambda i: valid if i else invalid)


def floats(lo: float, hi: float, bad: float) -> st.SearchStrategy[float]:
    return mostly(st.floats(min_value=lo, max_value=hi), st.sampled_from([bad, -1e308, 1e308]))


def ints(lo: int, hi: int, bad: int) -> st.SearchStrategy[int]:
    return mostly(st.integers(min_value=lo, max_value=hi), st.sampled_from([bad, -(2**63), 2**64]))


text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", ""])},
    optional={"content": st.text(max_size=20) | st.none() | st.lists(text_part, max_size=2),
              "name": st.text(max_size=5)})

# Plausible values, mostly in range and sometimes just out of it: these bodies reach the engine.
PLAUSIBLE = {
    "prompt": mostly(st.text(min_size=1, max_size=20) | st.lists(st.text(min_size=1, max_size=8), min_size=1,
                                                                  max_size=3)
                     | token_ids | st.lists(token_ids, min_size=1, max_size=2),
                     st.sampled_from(["", [], [[]], [512], [-1]])),
    "messages": st.lists(message, min_size=1, max_size=3),
    "model": mostly(st.sampled_from(["model", "default"]), st.just("other")),
    "max_tokens": ints(1, 40, 0),
    "max_completion_tokens": ints(1, 40, 0),
    "temperature": floats(0, 2, -0.1),
    "top_p": floats(0.01, 1, 0),
    "top_k": ints(-1, 600, -2),
    "min_p": floats(0, 1, 1.01),
    "n": ints(1, 4, 0),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "seed": ints(-(2**63), 2**63 - 200, 2**63),
    "presence_penalty": floats(-2, 2, 2.5),
    "frequency_penalty": floats(-2, 2, -2.5),
    "repetition_penalty": floats(0.01, 3, 0),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(min_value=-1, max_value=2**63), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "echo": mostly(st.just(False), st.just(True)),
}
LOGPROBS = {"/v1/completions": {"logprobs": ints(0, 5, 21)},
            "/v1/chat/completions": {"logprobs": st.booleans(), "top_logprobs": ints(0, 5, 21)}}
OPTIONAL = {k: v for k, v in PLAUSIBLE.items() if k not in ("prompt", "messages")}


def _requests(path: str, required: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """Plausible bodies for `path`, some with a field or two swapped for any JSON at all."""
    plausible = st.fixed_dictionaries({required: PLAUSIBLE[required]}, optional={**OPTIONAL, **LOGPROBS[path]})
    swaps = st.dictionaries(st.sampled_from(sorted(PLAUSIBLE)), json_values, max_size=2)
    mutated = st.builds(lambda body, swap: {**body, **swap}, plausible, swaps)
    return (plausible | mutated).map(lambda body: (path, json.dumps(body).encode()))


paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
cases = (_requests("/v1/completions", "prompt") | _requests("/v1/chat/completions", "messages")
         | st.tuples(paths, json_values.map(lambda v: json.dumps(v).encode()))
         | st.tuples(paths, st.binary(max_size=40)))


@pytest.fixture(scope="module")
def client(tiny_llama):
    """A small context and few seats, so that whatever the fuzzer asks for stays quick."""
    with app_client(make_app(tiny_llama.gguf_path, max_model_len=32, max_num_seqs=4, max_queue=4,
                             request_timeout=20.0)) as c:
        yield c


@pytest.mark.slow
@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_random_bodies_never_500(client, case):
    path, body = case
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code != 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == ERROR_FIELDS
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        assert "internal_server_error" not in response.text and "engine_error" not in response.text
    assert client.get("/health").status_code == 200
