"""Speculative decoding under a constraint: greedy output identical with and without ngram and
draft-model speculation, a forbidden draft rejected and the matcher rolled back, and the constrained
sampling distribution kept exactly (the chi-square test test_spec.py runs unconstrained)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_spec import N_SAMPLES, chi_square_pvalue_is_tiny, llm, prompts
from tiny_models import make_tiny_model

from wallbreaker import LLM, SamplingParams
from wallbreaker.engine.client import EngineRequest
from wallbreaker.engine.structured_output import StructuredOutputs
from wallbreaker.sampling_params import StructuredOutputsParams as Constraint

SCHEMA = {"type": "object", "properties": {
    "a": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": -50, "maximum": 5000},
    "xs": {"type": "array", "items": {"enum": ["p", "q", "rs"]}, "maxItems": 6}},
    "required": ["a", "n", "xs"], "additionalProperties": False}
CONSTRAINTS = [Constraint(json=SCHEMA), Constraint(json=SCHEMA, disable_any_whitespace=True),
               Constraint(regex=r"([a-z]+ ){2,6}[0-9]{1,3}")]


@pytest.fixture(scope="module")
def target(tiny_llama) -> str:
    return str(tiny_llama.hf_dir)


@pytest.fixture(scope="module")
def poor_draft(tmp_path_factory) -> str:
    """Same architecture and tokenizer, different random weights: a draft that is often wrong."""
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("draft"), seed=1).hf_dir)


def greedy(constraint: Constraint) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)


@pytest.fixture(scope="module")
def plain_outputs(target):
    plain = llm(target)
    return [[o.outputs[0].token_ids for o in plain.generate(prompts(), greedy(c))] for c in CONSTRAINTS]


@pytest.mark.parametrize("method", ["ngram", "draft-same", "draft-poor"])
def test_greedy_under_a_constraint_is_the_same_with_speculation(target, poor_draft, plain_outputs, method):
    kw = {"speculative_method": "ngram"} if method == "ngram" else {
        "speculative_method": "draft", "speculative_model": target if method == "draft-same" else poor_draft}
    spec = llm(target, num_speculative_tokens=4, speculative_adaptive=False, **kw)
    for constraint, expected in zip(CONSTRAINTS, plain_outputs):
        assert [o.outputs[0].token_ids for o in spec.generate(prompts(), greedy(constraint))] == expected, constraint
    stats = spec.stats()
    assert stats["spec_accepted"] > 0 and stats["kv_blocks_used"] == 0


def test_a_forbidden_draft_is_rejected_and_the_matcher_rolls_back(target):
    """Target logits that favour a digit where the grammar allows only letters: the digit draft is
    rejected, the best allowed token takes its place, and the matcher is where it was."""
    spec = llm(target, speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=False)
    engine, tok = spec.engine, spec.tokenizer
    engine.add_request(EngineRequest(tok.encode("Hello"), SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=Constraint(regex=r"[a-z]{3,30}"))))
    engine.step()  # the prompt, and a first letter
    seq = engine.scheduler.running[0]
    letter, digit, other = (tok.encode(t, add_special_tokens=False)[0] for t in ("ab", "7", "c"))
    drafts = [letter, digit, letter]
    before = seq.grammar.valid_prefix(drafts)
    assert before == 1
    logits = torch.full((4, engine.vocab_limit), -10.0)
    logits[0, letter] = logits[1, digit] = logits[2, letter] = 10.0
    logits[1, other] = 5.0  # the best token the grammar allows after the first draft
    seq.spec_token_ids = drafts
    assert engine.speculator.verify_drafts(seq, logits, engine.structured) == [letter, other]
    assert seq.grammar.valid_prefix(drafts) == before and seq.grammar.valid_prefix([letter, other]) == 2
    seq.drop_drafts()
    while engine.has_unfinished():
        engine.step()


# -- the constrained distribution under speculative sampling ---------------------------------------
PROMPT = [17, 42, 99, 7]
LETTERS = Constraint(regex=r"[a-z]{8,16}")  # no end of sequence within the first two tokens


def exact_constrained_second_token(hf_model, structured: StructuredOutputs, top_k: int) -> dict[int, float]:
    """The second token's distribution: softmax over the top_k of the logits the grammar allows, at
    each of the two positions (the second one's mask after the first token)."""
    grammar = structured.compile(LETTERS)

    def probs(ids, matcher):
        with torch.no_grad():
            logits = hf_model(torch.tensor([PROMPT + ids])).logits[0, -1].float()
        bits = torch.empty(structured.words, dtype=torch.int32)
        matcher.fill(bits)
        allowed = torch.tensor([(int(bits[t // 32]) >> (t % 32)) & 1 for t in range(logits.numel())], dtype=torch.bool)
        logits = logits.masked_fill(~allowed, float("-inf"))
        top = torch.topk(logits, top_k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))
    out: Counter = Counter()
    for t1, p1 in probs([], grammar.matcher()).items():
        second = grammar.matcher()
        assert second.accept(t1)
        for t2, p2 in probs([t1], second).items():
            out[t2] += p1 * p2
    return {t: p for t, p in out.items() if p > 0}


def sample_constrained_second_tokens(model: str, draft: str, n: int, top_k: int) -> Counter:
    engine = llm(model, max_num_seqs=64, speculative_method="draft", speculative_model=draft,
                 num_speculative_tokens=3, speculative_adaptive=False)
    params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, seed=s, structured_outputs=LETTERS)
              for s in range(n)]
    outs = engine.generate([{"prompt_token_ids": PROMPT}] * n, params)
    assert engine.stats()["spec_proposed"] > 0
    return Counter(o.outputs[0].token_ids[1] for o in outs)


@pytest.fixture(scope="module")
def constrained_case(tiny_llama, target):
    return exact_constrained_second_token(tiny_llama.load_hf(), llm(target).engine.structured, top_k=6)


@pytest.mark.slow
def test_constrained_sampling_with_a_poor_draft_matches_the_constrained_distribution(target, poor_draft,
                                                                                     constrained_case):
    counts = sample_constrained_second_tokens(target, poor_draft, N_SAMPLES, top_k=6)
    assert not chi_square_pvalue_is_tiny(counts, constrained_case, N_SAMPLES)


@pytest.mark.slow
def test_the_check_catches_plain_acceptance_of_constrained_drafts(target, poor_draft, constrained_case, monkeypatch):
    """Accepting every (grammar-valid) draft outright gives the draft's distribution, not the target's:
    it must be detected, or the test above proves nothing."""
    from wallbreaker.spec_decode import rejection
    import wallbreaker.spec_decode.speculator as speculator

    def accept_all(target_probs, draft_probs, drafts, generator):
        return len(drafts), rejection._draw(target_probs[len(drafts)], generator)
    monkeypatch.setattr(speculator, "verify", accept_all)
    counts = sample_constrained_second_tokens(target, poor_draft, N_SAMPLES, top_k=6)
    assert chi_square_pvalue_is_tiny(counts, constrained_case, N_SAMPLES)


# -- the same on the real model -------------------------------------------------------------------
@pytest.mark.real_model
def test_greedy_under_a_schema_on_smollm2_is_the_same_with_ngram_and_draft_speculation(packaged_model):
    """Real JSON repeats its keys and punctuation, so prompt n-grams propose drafts the grammar
    forbids as well as ones it allows; float32, so the tokens must be identical."""
    path = packaged_model("smollm2")
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "object", "properties": {
            "kind": {"enum": ["cat", "dog", "fish"]}, "name": {"type": "string", "maxLength": 12}},
            "required": ["kind", "name"], "additionalProperties": False}, "minItems": 1, "maxItems": 3}},
        "required": ["name", "age", "pets"], "additionalProperties": False}
    conversations = [[{"role": "user", "content": f"Describe person {i} and their pets as JSON: name, age, pets "
                                                  "(each with kind and name)."}] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=Constraint(json=schema))
    common = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_gb": 0.1}
    plain = [o.outputs[0].token_ids for o in LLM(path, **common).chat(conversations, params)]
    for kw in ({"speculative_method": "ngram"}, {"speculative_method": "draft", "speculative_model": str(path)}):
        spec = LLM(path, num_speculative_tokens=4, speculative_adaptive=False, **common, **kw)
        assert [o.outputs[0].token_ids for o in spec.chat(conversations, params)] == plain, kw
        assert spec.stats()["spec_accepted"] > 0
