"""Speculative decoding: greedy output identical to plain decoding, sampling distribution exactly the
target's, KV rollback without leaks, and the checks at load."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from tiny_models import make_tiny_model
from wallbreaker import LLM, InvalidRequestError, SamplingParams
from wallbreaker.kv.cache import bytes_per_block
from wallbreaker.spec_decode import rejection
from wallbreaker.spec_decode.ngram import propose_ngram

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_target(request, tiny_of):
    return tiny_of(request.param)


@pytest.fixture(scope="module")
def target(tiny_target):
    return str(tiny_target.hf_dir)


@pytest.fixture(scope="module")
def poor_draft(tiny_target, tmp_path_factory):
    """Same architecture and tokenizer, different random weights: a draft that is often wrong."""
    return str(make_tiny_model(tiny_target.arch, tmp_path_factory.mktemp("draft"), seed=1).hf_dir)


def prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(6):
        motif = [rng.randrange(3, 500) for _ in range(rng.randint(2, 6))]
        out.append({"prompt_token_ids": (motif * 8)[: rng.randint(5, 40)]})
    return out


def llm(model, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_gb", 0.02)
    return LLM(model, dtype="float32", **kw)


@pytest.fixture(scope="module")
def plain_greedy(target):
    return [o.outputs[0].token_ids for o in llm(target).generate(prompts(), GREEDY)]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_with_ngram_speculation_is_token_for_token_plain_greedy(target, plain_greedy, k):
    spec = llm(target, speculative_method="ngram", num_speculative_tokens=k, speculative_adaptive=False)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts(), GREEDY)] == plain_greedy
    stats = spec.stats()
    assert stats["spec_proposed"] > 0 and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("draft_kind", ["same", "poor"])
def test_greedy_with_a_draft_model_is_token_for_token_plain_greedy(target, poor_draft, plain_greedy, k, draft_kind):
    draft = target if draft_kind == "same" else poor_draft
    spec = llm(target, speculative_method="draft", speculative_model=draft, num_speculative_tokens=k,
               speculative_adaptive=False)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts(), GREEDY)] == plain_greedy
    stats = spec.stats()
    if draft_kind == "same":
        assert stats["spec_acceptance_rate"] > 0.95  # the target drafting for itself agrees with itself
    assert stats["kv_blocks_used"] == 0
    assert spec.engine.speculator.draft.scheduler.stats()["kv_blocks_used"] == 0  # the draft's cache is freed too


def test_a_draft_model_under_a_token_budget_below_its_drafts_is_token_for_token_plain_greedy(target, plain_greedy):
    """5 tokens a step, 8 drafts: drafts are dropped unverified, the target draws the first itself, and
    the draft, whose cache holds that token already, still computes it again for its logits."""
    spec = llm(target, speculative_method="draft", speculative_model=target, num_speculative_tokens=8,
               speculative_adaptive=False, max_num_batched_tokens=5)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts(), GREEDY)] == plain_greedy
    assert spec.stats()["kv_blocks_used"] == 0
    assert spec.engine.speculator.draft.scheduler.stats()["kv_blocks_used"] == 0


def test_max_tokens_and_stop_strings_inside_an_accepted_run(target):
    plain = llm(target)
    spec = llm(target, speculative_method="ngram", num_speculative_tokens=8, speculative_adaptive=False)
    for max_tokens in (1, 2, 5, 9):
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts(1), p)] == \
               [o.outputs[0].token_ids for o in plain.generate(prompts(1), p)]
    text = plain.generate(prompts(1)[:1], GREEDY)[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    assert spec.generate(prompts(1)[:1], p)[0].outputs[0].text == plain.generate(prompts(1)[:1], p)[0].outputs[0].text


def test_speculation_survives_preemption_and_n_greater_than_one(target, plain_greedy):
    cfg = llm(target).model_config
    tiny_pool = llm(target, kv_block_size=4, kv_cache_memory_gb=48 * bytes_per_block(cfg, 4, torch.float32) / 2**30,
                    speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=False)
    assert [o.outputs[0].token_ids for o in tiny_pool.generate(prompts(), GREEDY)] == plain_greedy
    assert tiny_pool.stats()["num_preemptions"] > 0 and tiny_pool.stats()["kv_blocks_used"] == 0
    spec = llm(target, speculative_method="ngram", num_speculative_tokens=4)
    out = spec.generate(prompts()[:1], SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert [o.token_ids for o in out.outputs] == [plain_greedy[0]] * 3


def test_draft_with_another_vocabulary_is_refused(target, tiny_gemma3):
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm(target, speculative_method="draft", speculative_model=str(tiny_gemma3.hf_dir))


def test_ngram_proposes_what_followed_the_last_match():
    assert propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert propose_ngram([5, 6, 7], 2) == []
    assert propose_ngram([1, 2, 1, 2, 1], 4) == [2, 1]


# --- exactness under sampling ----------------------------------------------------------------------

def test_rejection_sampler_reproduces_the_target_distribution():
    """Exact enumeration: over the draft's choice x ~ q and the accept/resample outcome, the emitted
    token's probability is q(x)·min(1, p/q) + P(reject)·residual = p. Checked with many draws."""
    torch.manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = Counter()
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=g))
        accepted, token = rejection.verify(p, q, [x], g)
        counts[x if accepted else token] += 1
    empirical = torch.tensor([counts[i] / n for i in range(4)])
    assert (empirical - p[0]).abs().sum() / 2 < 0.015
    # a greedy target (one-hot p) keeps exactly the matching prefix and then its argmax
    one_hot = torch.eye(4)[[2, 1, 3]]
    assert rejection.verify(one_hot, None, [2, 0], None) == (1, 1)
    assert rejection.verify(one_hot, None, [2, 1], None) == (2, 3)


def chi_square_pvalue_is_tiny(counts: Counter, probs: dict[int, float], n: int) -> bool:
    """Pearson's chi-square against `probs`, rare outcomes pooled; True if p < 0.001."""
    common = [t for t, pr in probs.items() if pr * n >= 5]
    stat = sum((counts[t] - probs[t] * n) ** 2 / (probs[t] * n) for t in common)
    rest_p = 1 - sum(probs[t] for t in common)
    rest_c = n - sum(counts[t] for t in common)
    if rest_p * n >= 5:
        stat += (rest_c - rest_p * n) ** 2 / (rest_p * n)
        dof = len(common)
    else:
        dof = len(common) - 1
    # Wilson-Hilferty: the chi-square quantile at 1 - 0.001
    z = 3.0902
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat > critical


def exact_second_token_distribution(hf_model, prompt: list[int], top_k: int) -> dict[int, float]:
    def probs(ids):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, top_k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))
    out: Counter = Counter()
    for t1, p1 in probs(prompt).items():
        for t2, p2 in probs(prompt + [t1]).items():
            out[t2] += p1 * p2
    return dict(out)


def sample_second_tokens(model: str, draft: str | None, prompt: list[int], n: int, top_k: int) -> Counter:
    kw = dict(speculative_method="draft", speculative_model=draft, num_speculative_tokens=3,
              speculative_adaptive=False) if draft else {}
    engine = llm(model, max_num_seqs=64, **kw)
    params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, seed=s, ignore_eos=True) for s in range(n)]
    outs = engine.generate([{"prompt_token_ids": prompt}] * n, params)
    return Counter(o.outputs[0].token_ids[1] for o in outs)


@pytest.fixture(scope="module")
def distribution_case(tiny_target):
    prompt = [17, 42, 99, 7]
    return prompt, exact_second_token_distribution(tiny_target.load_hf(), prompt, top_k=6)


N_SAMPLES = 1500


@pytest.mark.slow
def test_sampling_with_a_poor_draft_matches_the_target_distribution(target, poor_draft, distribution_case):
    prompt, exact = distribution_case
    counts = sample_second_tokens(target, poor_draft, prompt, N_SAMPLES, top_k=6)
    assert not chi_square_pvalue_is_tiny(counts, exact, N_SAMPLES)


@pytest.mark.slow
def test_the_distribution_check_catches_plain_acceptance(target, poor_draft, distribution_case, monkeypatch):
    """Accepting every draft outright must be detected: otherwise the test above proves nothing."""
    def accept_all(target_probs, draft_probs, drafts, generator):
        return len(drafts), rejection._draw(target_probs[len(drafts)], generator)
    import wallbreaker.spec_decode.speculator as speculator
    monkeypatch.setattr(speculator, "verify", accept_all)
    prompt, exact = distribution_case
    counts = sample_second_tokens(target, poor_draft, prompt, N_SAMPLES, top_k=6)
    assert chi_square_pvalue_is_tiny(counts, exact, N_SAMPLES)


def test_speculation_behind_the_server_gives_the_plain_greedy_answers(target, plain_greedy):
    from server_apps import app_client
    from wallbreaker.server.app import build_app

    spec = llm(target, speculative_method="ngram", num_speculative_tokens=4)
    with app_client(build_app(spec)) as client:
        for prompt, expected in zip(prompts()[:3], plain_greedy[:3]):
            body = {"prompt": prompt["prompt_token_ids"], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            answer = client.post("/v1/completions", json=body).json()
            assert answer["choices"][0]["text"] == spec.tokenizer.decode(expected)
        metrics = client.get("/metrics").text
    assert "wallbreaker_spec_acceptance_rate" in metrics
    assert spec.stats()["kv_blocks_used"] == 0 and spec.stats()["spec_proposed"] > 0
