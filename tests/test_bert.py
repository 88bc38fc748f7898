"""The BERT encoder (models/bert.py) against transformers on tiny random weights: a mean-pooled
embedding model and a cross-encoder, batched and one by one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer

from wallbreaker import LLM
from wallbreaker.errors import InvalidRequestError
from wallbreaker.pooling_requests import pair_ids

TEXTS = ["the cat sat on the mat", "Paris is the capital of France!", "def f(x): return 42",
         "  leading spaces and UPPER case", "ice"]
DOCS = ["the dog ran fast", "paris is a city on a river", "banana fruit", "the cat sat", "cold water and ice"]


@pytest.fixture(scope="module")
def embed_llm(tiny_bert_embedding):
    return LLM(tiny_bert_embedding, dtype="float32")


@pytest.fixture(scope="module")
def cross_llm(tiny_bert_cross_encoder):
    return LLM(tiny_bert_cross_encoder, dtype="float32")


def _reference_embeddings(folder, texts: list[str]) -> torch.Tensor:
    """transformers' BertModel, mean over every token of the text (sentence-transformers' mean
    pooling: [CLS] and [SEP] included), normalized."""
    from transformers import BertModel
    model = BertModel.from_pretrained(folder, dtype=torch.float32).eval()
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok.encode(text).ids])
            rows.append(model(input_ids=ids).last_hidden_state[0].mean(0))
    return F.normalize(torch.stack(rows), dim=-1)


def test_embeddings_match_transformers_batched_and_alone(embed_llm, tiny_bert_embedding):
    ref = _reference_embeddings(tiny_bert_embedding, TEXTS)
    batched = torch.tensor(embed_llm.embed(TEXTS))
    alone = torch.tensor([embed_llm.embed(t)[0] for t in TEXTS])
    torch.testing.assert_close(batched, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(alone, ref, atol=1e-5, rtol=0)


def test_matryoshka_dimensions_are_the_first_values_renormalized(embed_llm, tiny_bert_embedding):
    ref = _reference_embeddings(tiny_bert_embedding, TEXTS[:2])
    cut = torch.tensor(embed_llm.embed(TEXTS[:2], dimensions=8))
    torch.testing.assert_close(cut, F.normalize(ref[:, :8], dim=-1), atol=1e-5, rtol=0)


def test_token_ids_embed_as_their_text(embed_llm):
    ids = embed_llm.tokenizer.encode(TEXTS[1])
    assert embed_llm.embed(ids) == embed_llm.embed(TEXTS[1])


def test_pair_encoding_is_berts_pair_template(cross_llm, tiny_bert_cross_encoder):
    """Our ids and the token types the model derives from them are the Hugging Face tokenizer's pair encoding."""
    tok = HFTokenizer.from_file(str(tiny_bert_cross_encoder / "tokenizer.json"))
    model = cross_llm.model
    for doc in DOCS:
        ref = tok.encode(TEXTS[0], doc)
        ids = pair_ids(cross_llm.tokenizer, TEXTS[0], doc, None)
        assert ids == ref.ids
        types = model.token_type_ids(torch.tensor(ids), [(0, len(ids))])
        assert types.tolist() == ref.type_ids


def test_cross_encoder_scores_match_transformers(cross_llm, tiny_bert_cross_encoder):
    from transformers import BertForSequenceClassification
    model = BertForSequenceClassification.from_pretrained(tiny_bert_cross_encoder, dtype=torch.float32).eval()
    tok = HFTokenizer.from_file(str(tiny_bert_cross_encoder / "tokenizer.json"))
    with torch.no_grad():
        ref = [torch.sigmoid(model(input_ids=torch.tensor([e.ids]), token_type_ids=torch.tensor([e.type_ids])).logits)
               .item() for e in (tok.encode(TEXTS[0], d) for d in DOCS)]
    scores = cross_llm.score(TEXTS[0], DOCS)
    assert scores == pytest.approx(ref, abs=1e-4)
    alone = [cross_llm.score(TEXTS[0], d)[0] for d in DOCS]
    assert alone == pytest.approx(ref, abs=1e-4)
    ranked = cross_llm.rerank(TEXTS[0], DOCS)
    assert [r["index"] for r in ranked] == sorted(range(len(DOCS)), key=lambda i: -ref[i])


def test_an_encoder_refuses_to_generate(embed_llm):
    with pytest.raises(InvalidRequestError, match="cannot generate"):
        embed_llm.generate("the cat")


def test_a_cross_encoder_refuses_to_embed_and_an_embedder_scores_by_cosine(cross_llm, embed_llm):
    with pytest.raises(InvalidRequestError, match="cross-encoder"):
        cross_llm.embed("the cat")
    a, b = embed_llm.embed(["the cat", "the dog"])
    assert embed_llm.score("the cat", "the dog")[0] == pytest.approx(float(torch.tensor(a) @ torch.tensor(b)), abs=1e-6)
