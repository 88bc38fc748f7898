"""LoRA adapters on the server (issue 52): an adapter's name as the request's `model` on the OpenAI
and Ollama APIs gives what `LLM.generate` with that adapter gives; vLLM's load/unload endpoints and
answers; /v1/models lists adapters with their base as `parent`; a bad adapter is a 400 that changes
nothing."""
from __future__ import annotations

import pytest

from server_apps import app_client, assert_openai_error
from tiny_lora import make_peft_adapter
from wallbreaker import LLM, LoRARequest, SamplingParams
from wallbreaker.server.app import build_app

PROMPT = [1, 5, 9, 30, 41, 7, 22, 3]


@pytest.fixture(scope="module")
def lora_server(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("server_lora")
    adapters = {name: make_peft_adapter(tiny_llama, out / name, seed=seed) for name, seed in (("one", 1), ("two", 2))}
    llm = LLM(str(tiny_llama.hf_dir), dtype="float32", max_model_len=64, max_num_seqs=4, enable_lora=True,
              max_loras=2)
    llm.engine.load_lora_adapter("one", str(adapters["one"]))
    expected = {"base": _expected(llm, None), "one": _expected(llm, LoRARequest("one", 1)),
                "two": _expected(llm, LoRARequest("two-ref", 2, str(adapters["two"])))}
    llm.engine.unload_lora_adapter("two-ref")  # from here on only the server's engine thread steps `llm`
    with app_client(build_app(llm, served_model_name="base")) as client:
        yield client, expected, adapters


def _expected(llm: LLM, lora: LoRARequest | None) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return llm.generate([PROMPT], params, lora_request=lora)[0].outputs[0].text


def _completion(client, model: str) -> str:
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                              "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model
    return body["choices"][0]["text"]


def test_adapter_name_as_model_runs_that_adapter_and_load_unload_follow_vllm(lora_server):
    client, expected, adapters = lora_server
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["one"]["parent"] == "base" and models["base"]["parent"] is None and "two" not in models

    r = client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": str(adapters["two"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'two' added successfully."
    assert_openai_error(client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": str(adapters["two"])}),
                        400)
    one = _completion(client, "one")
    two = _completion(client, "two")
    base = _completion(client, "base")
    assert len({one, two, base}) == 3
    assert {"one": one, "two": two, "base": base} == expected

    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "two"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'two' removed successfully."
    assert "two" not in {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert_openai_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "two"}), 404)


def test_chat_and_ollama_take_the_adapter_name(lora_server):
    client, _, _ = lora_server
    messages = [{"role": "user", "content": "hello there"}]
    chat = {name: client.post("/v1/chat/completions", json={"model": name, "messages": messages, "max_tokens": 5,
                                                            "temperature": 0}).json() for name in ("one", "base")}
    assert chat["one"]["model"] == "one"
    assert chat["one"]["choices"][0]["message"]["content"] != chat["base"]["choices"][0]["message"]["content"]
    ollama = client.post("/api/chat", json={"model": "one", "messages": messages, "stream": False,
                                            "options": {"num_predict": 5, "temperature": 0}})
    assert ollama.status_code == 200, ollama.text
    assert ollama.json()["message"]["content"] == chat["one"]["choices"][0]["message"]["content"]


def test_a_bad_adapter_is_a_400_and_the_server_goes_on(lora_server, tmp_path):
    client, _, _ = lora_server
    before = _completion(client, "one")
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    for path in (str(tmp_path), str(tmp_path / "missing")):
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
        assert_openai_error(r, 400)
    assert "bad" not in {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert _completion(client, "one") == before


def test_router_serves_an_adapter_on_its_base_model(lora_server, tiny_llama, tiny_qwen2):
    from wallbreaker.errors import WallbreakerError
    from wallbreaker.server.lora_adapters import LoRAModule
    from wallbreaker.server.model_sources import ModelSource
    from wallbreaker.server.router import ModelRouter
    _, expected, adapters = lora_server
    sources = [ModelSource("llama", str(tiny_llama.hf_dir)), ModelSource("qwen2", str(tiny_qwen2.hf_dir))]

    def load(source: ModelSource) -> LLM:
        return LLM(source.model, dtype="float32", max_model_len=64, max_num_seqs=4, enable_lora=True, max_loras=2)
    with pytest.raises(WallbreakerError, match="name its base model"):
        ModelRouter(sources, load, lora_modules=[LoRAModule("one", str(adapters["one"]))])
    router = ModelRouter(sources, load, lora_modules=[LoRAModule("one", str(adapters["one"]), "llama")])
    with app_client(build_app(router)) as client:
        models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert models["one"]["parent"] == "llama" and models["qwen2"]["parent"] is None
        assert _completion(client, "one") == expected["one"]
        assert _completion(client, "llama") == expected["base"]


def test_lora_modules_flag_takes_name_path_and_vllms_json_form():
    from wallbreaker.cli import lora_modules
    from wallbreaker.errors import WallbreakerError
    from wallbreaker.server.lora_adapters import LoRAModule
    assert lora_modules(["sql=/a/b=c", '{"name": "chat", "path": "/x.gguf", "base_model_name": "qwen"}']) == \
        [LoRAModule("sql", "/a/b=c"), LoRAModule("chat", "/x.gguf", "qwen")]
    for bad in ("noequals", "=path", '{"name": "x"}', "{not json"):
        with pytest.raises(WallbreakerError, match="--lora-modules"):
            lora_modules([bad])
