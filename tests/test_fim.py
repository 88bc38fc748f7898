"""Fill-in-the-middle (text/fim.py): `suffix` on /v1/completions and llama.cpp's POST /infill, on a
tiny model given FIM tokens by its GGUF metadata, and on Qwen2.5-Coder-0.5B against transformers."""
import dataclasses
import json

import pytest
import torch
from server_apps import app_client, assert_openai_error, make_app

from wallbreaker.text.fim import ExtraFile, FimTokens
from wallbreaker.server.app import build_app

# three ordinary tokens of the tiny vocabulary stand for FIM prefix, suffix and middle
PRE, SUF, MID = 5, 6, 7


@pytest.fixture(scope="module")
def fim_client(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("fim") / "fim.gguf"
    metadata = {**tiny_llama.tokenizer_metadata, "tokenizer.ggml.fim_pre_token_id": PRE,
                "tokenizer.ggml.fim_suf_token_id": SUF, "tokenizer.ggml.fim_mid_token_id": MID}
    tiny = dataclasses.replace(tiny_llama, tokenizer_metadata=metadata, gguf_path=path)
    tiny.write_gguf(path)
    with app_client(make_app(path, max_model_len=128)) as client:
        yield client


@pytest.fixture(scope="module")
def plain_client(tiny_llama):
    with app_client(make_app(tiny_llama.gguf_path, max_model_len=128)) as client:
        yield client


def encode(client, text: str) -> list[int]:
    return client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def added_bos(client) -> list[int]:
    """The BOS the tokenizer adds to a prompt ([] if none)."""
    with_bos = client.post("/tokenize", json={"prompt": "x"}).json()["tokens"]
    return with_bos[:len(with_bos) - len(encode(client, "x"))]


def completion_of_ids(client, ids: list[int], **fields) -> str:
    r = client.post("/v1/completions", json={"prompt": ids, "temperature": 0, "max_tokens": 8, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_suffix_asks_for_the_middle_in_the_fim_layout(fim_client):
    prefix, suffix = "def add(a, b):\n    return", "\n\nprint(add(1, 2))"
    bos = added_bos(fim_client)
    by_hand = bos + [PRE] + encode(fim_client, prefix) + [SUF] + encode(fim_client, suffix) + [MID]
    r = fim_client.post("/v1/completions", json={"prompt": prefix, "suffix": suffix, "temperature": 0,
                                                 "max_tokens": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(by_hand)
    assert body["choices"][0]["text"] == completion_of_ids(fim_client, by_hand)
    # without the suffix, the same prompt is a plain completion: a different prompt
    plain = fim_client.post("/v1/completions", json={"prompt": prefix, "temperature": 0, "max_tokens": 8}).json()
    assert plain["usage"]["prompt_tokens"] != len(by_hand)


def test_ollama_generate_with_a_suffix_is_the_completions_middle(fim_client):
    prefix, suffix = "def add(a, b):\n    return", "\n\nprint(add(1, 2))"
    model = fim_client.get("/v1/models").json()["data"][0]["id"]
    r = fim_client.post("/api/generate", json={"model": model, "prompt": prefix, "suffix": suffix, "stream": False,
                                               "options": {"temperature": 0, "num_predict": 8}})
    assert r.status_code == 200, r.text
    same = fim_client.post("/v1/completions", json={"prompt": prefix, "suffix": suffix, "temperature": 0,
                                                    "max_tokens": 8}).json()
    assert r.json()["response"] == same["choices"][0]["text"]
    assert r.json()["prompt_eval_count"] == same["usage"]["prompt_tokens"]


def test_infill_takes_llama_cpp_fields_and_answers_in_its_shape(fim_client):
    body = {"input_prefix": "def f(x):\n", "input_suffix": "\n    return y\n", "prompt": "    y =",
            "input_extra": [{"filename": "util.py", "text": "import os\n"}], "temperature": 0, "n_predict": 6}
    r = fim_client.post("/infill", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    # no FIM_REP / FIM_SEP tokens here: the extra file comes first, after a snippet separator
    by_hand = encode(fim_client, "\n\n--- snippet ---\n\n") + encode(fim_client, "import os\n") + [PRE] \
        + encode(fim_client, "def f(x):\n") + encode(fim_client, "    y =") + [SUF] \
        + encode(fim_client, "\n    return y\n") + [MID]
    bos = added_bos(fim_client)
    assert out["tokens_evaluated"] == len(bos + by_hand)
    assert out["content"] == completion_of_ids(fim_client, bos + by_hand, max_tokens=6)
    assert out["stop"] is True and out["stop_type"] in ("eos", "limit") and out["tokens_predicted"] <= 6
    # streamed: llama.cpp's events, the pieces adding up to the same content, no [DONE]
    with fim_client.stream("POST", "/infill", json={**body, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line]
    chunks = [json.loads(line.removeprefix("data: ")) for line in events]
    assert "".join(c["content"] for c in chunks) == out["content"]
    assert chunks[-1]["stop"] is True and all(c["stop"] is False for c in chunks[:-1])


def test_infill_accepts_llama_vscode_requests(fim_client):
    """llama.vscode's request as it sends it (its samplers list, time limits, indentation): answered,
    the reply bounded by n_predict; a sampler name llama.cpp does not know is still a 400."""
    body = {"input_prefix": "def f(x):\n", "input_suffix": "\n    return y\n", "input_extra": [], "prompt": "    y =",
            "n_predict": 5, "top_k": 40, "top_p": 0.99, "stream": False, "n_indent": 4,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000, "response_fields": ["content", "timings/prompt_n"]}
    r = fim_client.post("/infill", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens_predicted"] <= 5
    assert_openai_error(fim_client.post("/infill", json={**body, "samplers": ["top_k", "bogus"]}), 400)


def test_a_model_without_fim_tokens_is_a_400_naming_the_reason(plain_client):
    r = plain_client.post("/v1/completions", json={"prompt": "def f(", "suffix": ")", "max_tokens": 4})
    error = assert_openai_error(r, 400, "suffix")
    assert "fill-in-the-middle" in error["message"]
    r = plain_client.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")"})
    assert "fill-in-the-middle" in assert_openai_error(r, 400)["message"]


@pytest.mark.parametrize("body, param", [
    ({"input_suffix": ")"}, "input_prefix"),
    ({"input_prefix": "a"}, "input_suffix"),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": "x"}, "input_extra"),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "f"}]}, None),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "t", "size": 1}]}, None),
    ({"input_prefix": "a", "input_suffix": "b", "n_predict": 0}, "n_predict"),
    ({"input_prefix": "a", "input_suffix": "b", "temperature": -1}, "temperature"),
    ({"input_prefix": "a", "input_suffix": "b", "repeat_penalty": 0}, "repeat_penalty"),
    ({"input_prefix": "a", "input_suffix": "b", "dry_multiplier": -1}, "dry_multiplier"),
    ({"input_prefix": "a", "input_suffix": "b", "mirostat": 1}, "mirostat_mode"),
    ({"input_prefix": "a", "input_suffix": "b", "xtc_threshold": 2}, "xtc_threshold"),
    ({"input_prefix": "a", "input_suffix": "b", "seed": -2}, None),
    ({"input_prefix": 3, "input_suffix": "b"}, None),
])
def test_bad_infill_input_is_a_400(fim_client, body, param):
    assert_openai_error(fim_client.post("/infill", json=body), 400, param)
    assert fim_client.get("/health").status_code == 200


def test_suffix_with_token_id_prompts_and_bad_prompts(fim_client):
    ids = encode(fim_client, "def f(")
    r = fim_client.post("/v1/completions", json={"prompt": ids, "suffix": ")", "temperature": 0, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert_openai_error(fim_client.post("/v1/completions", json={"prompt": [10**9], "suffix": ")"}), 400)


# -- the real thing --------------------------------------------------------------------------------
# the instruct model fills a hole inside a body (with an empty body it writes prose about the code)
FIM_PREFIX = "def fibonacci(n):\n    if n < 2:\n        return n\n    return "
FIM_SUFFIX = "\n\nprint(fibonacci(10))\n"
FIM_TOKENS = 16


@pytest.mark.real_model
def test_qwen_coder_fills_in_a_function_body_as_transformers_does(packaged_model):
    """The greedy middle of Qwen2.5-Coder-0.5B, through `suffix`, against transformers on the same
    (dequantized) weights and the FIM prompt its model card documents."""
    path = packaged_model("qwen2.5-coder-0.5b")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = f"<|fim_prefix|>{FIM_PREFIX}<|fim_suffix|>{FIM_SUFFIX}<|fim_middle|>"
    ref_ids = ref_tok(text)["input_ids"]

    from wallbreaker import LLM
    llm = LLM(str(path), dtype="float32", max_model_len=256, max_num_seqs=1)
    fim = FimTokens.of(llm.tokenizer)
    assert [fim.pre, fim.suf, fim.mid] == ref_tok.convert_tokens_to_ids(["<|fim_prefix|>", "<|fim_suffix|>",
                                                                          "<|fim_middle|>"])
    assert fim.prompt(llm.tokenizer, FIM_PREFIX, FIM_SUFFIX) == ref_ids
    # /infill's layout with extra files, against the same text tokenized whole
    extra_text = (f"<|repo_name|>myproject\n<|file_sep|>util.py\nimport math\n<|file_sep|>filename\n"
                  f"<|fim_prefix|>{FIM_PREFIX}<|fim_suffix|>{FIM_SUFFIX}<|fim_middle|>")
    assert fim.prompt(llm.tokenizer, FIM_PREFIX, FIM_SUFFIX, repo_level=True,
                      extra=[ExtraFile("import math\n", "util.py")]) == ref_tok(extra_text)["input_ids"]

    with app_client(build_app(llm)) as client:
        r = client.post("/v1/completions", json={"prompt": FIM_PREFIX, "suffix": FIM_SUFFIX, "temperature": 0,
                                                 "max_tokens": FIM_TOKENS})
        assert r.status_code == 200, r.text
        middle = r.json()["choices"][0]["text"]

    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([ref_ids]), attention_mask=torch.ones(1, len(ref_ids), dtype=torch.long),
                           max_new_tokens=FIM_TOKENS, do_sample=False, pad_token_id=0,
                           eos_token_id=sorted(llm.engine.eos_token_ids))
    new = out[0, len(ref_ids):].tolist()
    expected = ref_tok.decode([t for t in new if t not in llm.engine.eos_token_ids], skip_special_tokens=True)
    assert middle == expected
    assert "fibonacci(n" in middle  # the recursion the body needs, not noise
