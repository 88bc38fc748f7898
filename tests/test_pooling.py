"""Pooling through the engine: a decoder embedding model (Qwen3-Embedding's layout: last-token
pooling) against transformers, pooling sequences computed whole and freed in their step, beside
generation in the same batches, and the refusals."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wallbreaker import LLM, SamplingParams
from wallbreaker.engine.client import EngineRequest
from wallbreaker.errors import InvalidRequestError
from wallbreaker.pooling_params import PoolingParams
from wallbreaker.pooling_requests import input_ids

TEXTS = ["Instruct: find the capital\nQuery: what is the capital of France?", "hello", "a b c d e f g h",
         "The quick brown fox jumps over the lazy dog " * 4]


@pytest.fixture(scope="module")
def qwen3_embed(tiny_qwen3_embedding):
    return LLM(tiny_qwen3_embedding, dtype="float32", max_model_len=128, max_num_batched_tokens=64)


def test_last_token_embeddings_match_transformers(qwen3_embed, tiny_qwen3_embedding):
    """transformers' final hidden state (after the last norm) at the last token, normalized."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_embedding, dtype=torch.float32).eval()
    ids = [qwen3_embed.tokenizer.encode(t) for t in TEXTS]
    with torch.no_grad():
        ref = torch.stack([model.model(input_ids=torch.tensor([i])).last_hidden_state[0, -1] for i in ids])
    ref = F.normalize(ref, dim=-1)
    torch.testing.assert_close(torch.tensor(qwen3_embed.embed(TEXTS)), ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor([qwen3_embed.embed(t)[0] for t in TEXTS]), ref, atol=1e-4, rtol=0)


def test_pooling_sequences_run_whole_and_free_their_pages_in_their_step(qwen3_embed):
    """A prompt longer than the step's token budget (64) runs whole, alone; every step that
    computes a pooling sequence finishes it, so no page stays held."""
    engine = qwen3_embed.engine
    long_ids = list(range(5, 5 + 100))
    short = qwen3_embed.tokenizer.encode("hello")
    for i, ids in enumerate([short, long_ids, short]):
        engine.add_request(EngineRequest(ids, SamplingParams(max_tokens=1), request_id=f"p{i}",
                                         pooling=PoolingParams()))
    finished = []
    while engine.has_unfinished():
        batch_sizes = engine.stats()["num_running"]
        result = engine.step()
        finished += [o.request_id for o in result.finished]
        assert engine.stats()["kv_blocks_used"] == 0
        assert batch_sizes == 0
    assert finished == ["p0", "p1", "p2"]


def test_embeddings_and_generation_share_steps_and_generation_is_unchanged(qwen3_embed):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = qwen3_embed.generate(TEXTS[:2], greedy)
    ref = qwen3_embed.embed(TEXTS)
    engine = qwen3_embed.engine
    for i, text in enumerate(TEXTS[:2]):
        engine.add_request(EngineRequest(qwen3_embed.tokenizer.encode(text), greedy, text, f"g{i}"))
    outputs, mixed_steps = {}, 0
    step = 0
    while engine.has_unfinished():
        if step < len(TEXTS):  # an embedding request arrives at each of the first steps
            ids = qwen3_embed.tokenizer.encode(TEXTS[step])
            engine.add_request(EngineRequest(ids, SamplingParams(max_tokens=1), request_id=f"e{step}",
                                             pooling=PoolingParams()))
        step += 1
        result = engine.step()
        kinds = {o.request_id[0] for o in result.finished} | {d.request_id[0] for d in result.deltas}
        mixed_steps += kinds == {"e", "g"}
        outputs.update({o.request_id: o for o in result.finished})
    assert mixed_steps > 0
    assert [outputs[f"g{i}"].outputs[0].token_ids for i in range(2)] == [o.outputs[0].token_ids for o in alone]
    config = qwen3_embed.engine.pooling_config
    got = [F.normalize(outputs[f"e{i}"].pooled, dim=-1) for i in range(len(TEXTS))]
    torch.testing.assert_close(torch.stack(got), torch.tensor(ref), atol=1e-5, rtol=0)
    assert config.normalize and config.method == "last"


def test_a_generation_model_without_pooling_config_is_refused(tiny_qwen3):
    llm = LLM(tiny_qwen3.hf_dir, dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="cannot pool"):
        llm.embed("hello")


def test_bad_inputs_are_refused(qwen3_embed):
    with pytest.raises(InvalidRequestError, match="empty"):
        qwen3_embed.embed([])
    with pytest.raises(InvalidRequestError, match="empty"):
        qwen3_embed.embed([""])
    too_long = "word " * 400
    with pytest.raises(InvalidRequestError, match="limit of 128 tokens"):
        qwen3_embed.embed(too_long)
    assert len(qwen3_embed.embed(too_long, truncate_prompt_tokens=-1)[0]) == qwen3_embed.model_config.hidden_size
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        qwen3_embed.embed("hello", truncate_prompt_tokens=1000)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        qwen3_embed.embed("hello", dimensions=10_000)


def test_truncation_keeps_the_models_special_tokens(tiny_bert_embedding):
    llm = LLM(tiny_bert_embedding, dtype="float32")
    ids = input_ids(llm.tokenizer, "the cat sat on the mat " * 3, 6)
    full = llm.tokenizer.encode("the cat sat on the mat " * 3)
    assert ids == full[:5] + full[-1:] and ids[0] == llm.tokenizer.bos_token_id


def test_inputs_are_tokenized_with_the_post_processor_as_sentence_transformers_does(tiny_qwen3_embedding, tmp_path):
    """Qwen3-Embedding's tokenizer.json appends <|endoftext|> in its post-processor (not the EOS
    its tokenizer_config names): the embedding is that token's hidden state."""
    import json
    import shutil

    from tiny_models import BOS
    from tokenizers import Tokenizer as HFTokenizer, processors
    folder = tmp_path / "appends"
    shutil.copytree(tiny_qwen3_embedding, folder)
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single=f"$A {BOS}", special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(folder / "tokenizer.json"))
    llm = LLM(folder, dtype="float32", max_model_len=64)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok.encode(TEXTS[1]).ids
    assert ids[-1] == tok.token_to_id(BOS) and json.loads((folder / "modules.json").read_text())
    with torch.no_grad():
        ref = F.normalize(model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
    torch.testing.assert_close(torch.tensor(llm.embed(TEXTS[1])[0]), ref, atol=1e-4, rtol=0)


def test_a_long_embedding_request_is_not_held_back_by_running_generation(qwen3_embed):
    """The step's budget (64 tokens) minus the decoding sequences' tokens is less than the prompt:
    it runs whole beside them in the next step, not after they finish."""
    engine = qwen3_embed.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(3):
        engine.add_request(EngineRequest(qwen3_embed.tokenizer.encode(TEXTS[1]), greedy, None, f"g{i}"))
    engine.step()  # the three prompts
    engine.add_request(EngineRequest(list(range(5, 5 + 63)), SamplingParams(max_tokens=1), request_id="long",
                                     pooling=PoolingParams()))
    result = engine.step()
    assert "long" in [o.request_id for o in result.finished]
    assert {d.request_id for d in result.deltas} >= {"g0", "g1", "g2"}
    while engine.has_unfinished():
        engine.step()


def test_a_decoder_cross_encoder_scores_pairs_as_transformers_does(tiny_qwen3, tmp_path):
    """`Qwen3ForSequenceClassification` (a converted Qwen3-Reranker): the last token's final hidden
    state through its score head, sigmoid; against transformers on the same pairs, tokenized by
    transformers' own tokenizer. It cannot generate."""
    from tiny_pooling_models import make_tiny_qwen3_reranker
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    folder = make_tiny_qwen3_reranker(tiny_qwen3, tmp_path / "reranker")
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    query, docs = TEXTS[0], TEXTS[1:]
    with torch.no_grad():
        ref = [torch.sigmoid(model(**tok(query, d, return_tensors="pt")).logits[0, 0]).item() for d in docs]
    llm = LLM(folder, dtype="float32", max_model_len=128)
    assert llm.score(query, docs) == pytest.approx(ref, abs=1e-5)
    ranked = llm.rerank(query, docs)
    assert [r["index"] for r in ranked] == sorted(range(len(docs)), key=lambda i: -ref[i])
    with pytest.raises(InvalidRequestError, match="cannot generate"):
        llm.generate("hello", SamplingParams(max_tokens=2))
