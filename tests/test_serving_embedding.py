"""The pooling routes (server/serving_embedding.py): /v1/embeddings through the official `openai`
client, /v1/rerank and /rerank, /score, Ollama's /api/embed; bad input as 400s; embeddings and
generation served together."""
from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from server_apps import app_client, assert_openai_error, make_app
from wallbreaker import LLM, SamplingParams

TEXTS = ["the cat sat on the mat", "Paris is the capital of France!", "def f(x): return 42"]
DOCS = ["the dog ran fast", "paris is a city on a river", "banana fruit", "the cat sat", "cold water and ice"]


@pytest.fixture(scope="module")
def embed_client(tiny_bert_embedding):
    with app_client(make_app(tiny_bert_embedding)) as client:
        yield client


def _openai(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=client, max_retries=0)


def test_openai_client_embeddings_equal_llm_embed(embed_client, tiny_bert_embedding):
    expected = LLM(tiny_bert_embedding, dtype="float32").embed(TEXTS)
    api = _openai(embed_client)
    got = api.embeddings.create(model="default", input=TEXTS, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1, 2]
    torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), torch.tensor(expected), atol=1e-6, rtol=0)
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS)
    encoded = api.embeddings.create(model="default", input=TEXTS[0])  # the client asks for base64 and decodes it
    assert encoded.data[0].embedding == pytest.approx(expected[0], abs=1e-6)
    cut = api.embeddings.create(model="default", input=TEXTS[0], dimensions=8, encoding_format="float")
    assert cut.data[0].embedding == pytest.approx(F.normalize(torch.tensor(expected[0][:8]), dim=0).tolist(), abs=1e-6)


def test_base64_is_little_endian_float32(embed_client):
    body = embed_client.post("/v1/embeddings", json={"input": "the cat", "encoding_format": "base64"}).json()
    floats = embed_client.post("/v1/embeddings", json={"input": "the cat"}).json()
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(floats["data"][0]["embedding"], abs=1e-7)


def test_token_id_inputs(embed_client, tiny_bert_embedding):
    llm = LLM(tiny_bert_embedding, dtype="float32")
    ids = llm.tokenizer.encode(TEXTS[0])
    got = embed_client.post("/v1/embeddings", json={"input": [ids, ids[:3]]}).json()
    assert got["data"][0]["embedding"] == pytest.approx(llm.embed(TEXTS[0])[0], abs=1e-6)
    assert got["data"][1]["embedding"] == pytest.approx(llm.embed(ids[:3])[0], abs=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, None),
    ({"input": ""}, None),
    ({"input": "word " * 100}, None),  # past the limit (64) without truncation
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 1000}, "dimensions"),
    ({"input": "hi", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
    ({"input": [[1, -2]]}, "input"),
    ({"input": [[10 ** 9]]}, None),
    ({"input": 5}, "input"),
])
def test_bad_embedding_requests_are_400s(embed_client, body, param):
    error = assert_openai_error(embed_client.post("/v1/embeddings", json=body), 400, param)
    if body.get("input") == "word " * 100:
        assert "limit of 64 tokens" in error["message"]
    assert embed_client.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200


def test_truncation_only_when_asked(embed_client):
    got = embed_client.post("/v1/embeddings", json={"input": "word " * 100, "truncate_prompt_tokens": -1})
    assert got.status_code == 200 and got.json()["usage"]["prompt_tokens"] == 64


def test_a_generation_model_refuses_embeddings_with_a_400(tiny_qwen3):
    with app_client(make_app(tiny_qwen3.hf_dir)) as client:
        error = assert_openai_error(client.post("/v1/embeddings", json={"input": "hi"}), 400)
        assert "cannot pool" in error["message"]
        assert client.post("/api/embed", json={"model": "default", "input": "hi"}).status_code == 400


def test_rerank_orders_documents_as_the_reference_scores(tiny_bert_cross_encoder):
    from tokenizers import Tokenizer
    from transformers import BertForSequenceClassification
    model = BertForSequenceClassification.from_pretrained(tiny_bert_cross_encoder, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(tiny_bert_cross_encoder / "tokenizer.json"))
    with torch.no_grad():
        ref = [torch.sigmoid(model(input_ids=torch.tensor([e.ids]), token_type_ids=torch.tensor([e.type_ids])).logits)
               .item() for e in (tok.encode(TEXTS[0], d) for d in DOCS)]
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])
    with app_client(make_app(tiny_bert_cross_encoder)) as client:
        for route in ("/v1/rerank", "/rerank"):
            body = client.post(route, json={"model": "default", "query": TEXTS[0], "documents": DOCS}).json()
            assert [r["index"] for r in body["results"]] == order
            assert [r["relevance_score"] for r in body["results"]] == pytest.approx([ref[i] for i in order], abs=1e-4)
            assert body["results"][0]["document"] == {"text": DOCS[order[0]]}
        top = client.post("/v1/rerank", json={"query": TEXTS[0], "documents": [{"text": d} for d in DOCS],
                                              "top_n": 2, "return_documents": False}).json()
        assert [r["index"] for r in top["results"]] == order[:2] and "document" not in top["results"][0]
        scores = client.post("/score", json={"text_1": TEXTS[0], "text_2": DOCS}).json()
        assert [d["score"] for d in scores["data"]] == pytest.approx(ref, abs=1e-4)
        assert_openai_error(client.post("/v1/embeddings", json={"input": "hi"}), 400)
        assert_openai_error(client.post("/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), 400)


def test_ollama_embed(embed_client, tiny_bert_embedding):
    llm = LLM(tiny_bert_embedding, dtype="float32")
    body = embed_client.post("/api/embed", json={"model": "default", "input": TEXTS}).json()
    assert body["model"] == "default" and body["prompt_eval_count"] > 0
    torch.testing.assert_close(torch.tensor(body["embeddings"]), torch.tensor(llm.embed(TEXTS)), atol=1e-6, rtol=0)
    long = embed_client.post("/api/embed", json={"model": "default", "input": "word " * 100})
    assert long.status_code == 200  # Ollama truncates by default
    refused = embed_client.post("/api/embed", json={"model": "default", "input": "word " * 100, "truncate": False})
    assert refused.status_code == 400 and "limit" in refused.json()["error"]
    assert embed_client.post("/api/embed", json={"model": "default", "input": []}).json().keys() == {"error"}


def test_embeddings_and_generation_served_together(tiny_qwen3_embedding):
    """Completions while embeddings arrive: every request answered, the completions token for token
    what the model generates alone."""
    prompts = ["hello there", "the quick brown fox", "a b c"]
    llm = LLM(tiny_qwen3_embedding, dtype="float32", max_model_len=64, max_num_seqs=4)
    alone = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                                            ignore_eos=True))]
    expected_vectors = llm.embed(TEXTS)
    with app_client(make_app(tiny_qwen3_embedding, max_num_seqs=4)) as client:
        def complete(p):
            return client.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0,
                                                        "ignore_eos": True}).json()["choices"][0]["text"]

        def embed(t):
            return client.post("/v1/embeddings", json={"input": t}).json()["data"][0]["embedding"]
        with ThreadPoolExecutor(8) as pool:
            completions = [pool.submit(complete, p) for p in prompts]
            vectors = [pool.submit(embed, t) for t in TEXTS * 2]
            assert [f.result() for f in completions] == alone
            got = [f.result() for f in vectors]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected_vectors * 2), atol=1e-5, rtol=0)
