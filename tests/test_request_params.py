"""llama.cpp's sampler fields (DRY, XTC, typical_p, mirostat) on chat and completions: read into
`SamplingParams`, bad values a 400 naming them, and a seeded answer the same whatever runs beside it."""
import pytest
from server_apps import app_client, assert_openai_error, make_app

from wallbreaker.server.protocol import CompletionRequest
from wallbreaker.server.request_params import completion_params

LLAMA_CPP_FIELDS = {"typical_p": 0.9, "xtc_probability": 0.5, "xtc_threshold": 0.2, "dry_multiplier": 0.8,
                    "dry_base": 2.0, "dry_allowed_length": 3, "dry_penalty_last_n": 64,
                    "dry_sequence_breakers": ["\n", "."], "mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2}


def test_fields_reach_the_sampling_params():
    params, _ = completion_params(CompletionRequest(prompt="x", **LLAMA_CPP_FIELDS))
    for name, value in LLAMA_CPP_FIELDS.items():
        assert getattr(params, "mirostat_mode" if name == "mirostat" else name) == value, name
    defaults, _ = completion_params(CompletionRequest(prompt="x"))
    assert (defaults.typical_p, defaults.xtc_probability, defaults.dry_multiplier, defaults.mirostat_mode) == (1, 0, 0, 0)
    assert defaults.dry_sequence_breakers == ["\n", ":", "\"", "*"]  # llama.cpp's


@pytest.fixture(scope="module")
def client(tiny_llama):
    with app_client(make_app(tiny_llama.gguf_path, max_model_len=128, max_num_seqs=8)) as c:
        yield c


@pytest.mark.parametrize("extra, param", [
    ({"typical_p": 0}, "typical_p"),
    ({"xtc_probability": 1.5}, "xtc_probability"),
    ({"dry_multiplier": -0.5}, "dry_multiplier"),
    ({"dry_base": 0.5}, "dry_base"),
    ({"dry_allowed_length": -1}, "dry_allowed_length"),
    ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
    ({"dry_sequence_breakers": "x" * 41}, None),
    ({"mirostat": 1}, "mirostat_mode"),
    ({"mirostat_mode": 2, "mirostat": 0}, "mirostat_mode"),
    ({"mirostat_tau": 0}, "mirostat_tau"),
    ({"mirostat_eta": "fast"}, None),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_values_are_a_400_naming_the_field(client, path, extra, param):
    base = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    assert_openai_error(client.post(path, json={**base, "max_tokens": 2, **extra}), 400, param)


SAMPLERS = [{"dry_multiplier": 1.0, "dry_allowed_length": 1}, {"xtc_probability": 0.7, "xtc_threshold": 0.01},
            {"typical_p": 0.6}, {"mirostat": 2, "mirostat_tau": 3.0}]


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["dry", "xtc", "typical_p", "mirostat"])
def test_a_seeded_answer_is_the_same_alone_and_in_a_batch(client, sampler):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 11, "ignore_eos": True,
            **sampler}
    alone = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    # the same request as one prompt of a batch of several, beside unseeded ones
    batch = client.post("/v1/completions", json={**body, "prompt": ["Hello", "Once upon a time", "Numbers: 1 2"]})
    assert batch.status_code == 200, batch.text
    assert batch.json()["choices"][1]["text"] == alone
