import random

import pytest
import torch
from llama_sampler_reference import chi_square_rejects, dry_reference, first_token_counts, softmax

from wallbreaker.layers.dry import DryBreakers, dry_penalties
from wallbreaker.layers.sampler import processed_probs
from wallbreaker.sampling_params import SamplingParams

V = 12
N_DRAWS = 3000


def dry(**kw) -> SamplingParams:
    return SamplingParams(dry_multiplier=kw.pop("dry_multiplier", 0.8), **kw)


def test_the_llama_cpp_example_penalizes_the_tokens_that_extend_a_repetition():
    # llama.cpp's comment: "a b c c b c y a b c": c would make "a b c c" (3 -> 4), y "b c y" (2 -> 3)
    a, b, c, y = 1, 2, 3, 4
    params = dry(dry_allowed_length=2, dry_base=2.0)
    penalties = dry_penalties([a, b, c, c, b, c, y, a, b, c], params, frozenset())
    assert penalties == {c: 0.8 * 2.0 ** 1, y: 0.8 * 2.0 ** 0}


@pytest.mark.parametrize("seed", range(40))
def test_penalties_match_the_reference_on_random_contexts(seed):
    rng = random.Random(seed)
    context = [rng.randrange(5) for _ in range(rng.randrange(1, 60))]
    breakers = {rng.randrange(5)} if seed % 3 else set()
    allowed = rng.randrange(0, 4)
    params = dry(dry_allowed_length=allowed, dry_base=1.5)
    got = dry_penalties(context, params, frozenset(breakers))
    want = dry_reference(context, 5, 0.8, 1.5, allowed, breakers)
    assert [got.get(t, 0.0) for t in range(5)] == pytest.approx(want)


def test_penalty_last_n_limits_the_window():
    context = [1, 2, 3, 1, 2, 3, 7, 7, 7, 7, 1, 2]
    params = dry(dry_penalty_last_n=4, dry_allowed_length=1)
    assert dry_penalties(context, params, frozenset()) == \
        pytest.approx({t: v for t, v in enumerate(dry_reference(context[-4:], 8, 0.8, 1.75, 1, set())) if v})
    assert dry_penalties(context, dry(dry_penalty_last_n=0), frozenset()) == {}


def test_first_token_distribution_matches_the_reference():
    """The first sampled token's law, against the plain-Python DRY of the published algorithm."""
    context = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # "4" would extend a run of 3 (and 8 before it)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    logits[0, 4] += 2.0  # the repeating token is likely without DRY
    breakers = frozenset({9})
    params = dry(dry_multiplier=0.6, dry_base=1.3, dry_allowed_length=2)
    penalty = dry_reference(context, V, 0.6, 1.3, 2, set(breakers))
    want = softmax([v - d for v, d in zip(logits[0].tolist(), penalty)])
    counts = first_token_counts(logits, params, N_DRAWS, context, breakers)
    assert not chi_square_rejects(counts, want, N_DRAWS)
    # the check can fail: without the penalty the law is far from what was drawn
    assert chi_square_rejects(counts, softmax(logits[0].tolist()), N_DRAWS)


def test_a_breaker_at_the_end_of_the_context_stops_the_penalty():
    context = [1, 2, 9, 1, 2, 9, 1, 2, 9]
    assert dry_penalties(context, dry(), frozenset({9})) == {}
    assert dry_penalties(context, dry(), frozenset()) != {}


def test_breaker_ids_are_the_tokens_whose_text_holds_a_breaker(tiny_llama):
    from wallbreaker.text.tokenizer import Tokenizer
    tok = Tokenizer.from_hf_folder(tiny_llama.hf_dir)
    ids = DryBreakers(tok).ids(["\n", ":"])
    texts = {i: tok.token_bytes(i) for i in range(tok.vocab_size)}
    assert ids == {i for i, t in texts.items() if b"\n" in t or b":" in t}
    assert ids  # the tiny vocabulary has some


def test_greedy_rows_are_penalized_too():
    logits = torch.zeros(1, V)
    logits[0, 3] = 1.0
    logits[0, 5] = 0.9
    p = dry(temperature=0.0, dry_multiplier=1.0, dry_allowed_length=1)
    probs = processed_probs(logits, [p], [[1, 3, 2, 1]], [[]], dry_breakers=[frozenset()])
    assert probs[0].argmax().item() == 5  # 3 would extend "1" -> "1 3"


@pytest.mark.slow
@pytest.mark.real_model
def test_dry_cuts_verbatim_repetition_on_a_looping_prompt(packaged_model):
    """SmolLM2 (greedy) on a prompt that loops keeps looping; with DRY it leaves the loop."""
    from wallbreaker import LLM
    llm = LLM(packaged_model("smollm2"), dtype="float32", max_model_len=512, max_num_seqs=2)
    prompt = "the cat sat on the mat and the dog ate the hat, " * 6
    ids = llm.tokenizer.encode(prompt)
    plain, with_dry = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, dry_multiplier=0.8)])
    def repeated_fraction(out: list[int]) -> float:
        """The fraction of output 4-grams that occurred before, in the prompt or the output."""
        seq = ids + out
        seen = {tuple(seq[i:i + 4]) for i in range(len(ids) - 3)}
        hits = 0
        for i in range(len(ids), len(seq) - 3):
            gram = tuple(seq[i:i + 4])
            hits += gram in seen
            seen.add(gram)
        return hits / max(1, len(seq) - 3 - len(ids))
    before = repeated_fraction(plain.outputs[0].token_ids)
    after = repeated_fraction(with_dry.outputs[0].token_ids)
    assert before > 0.8, plain.outputs[0].text  # the loop is real
    assert after < before / 2, with_dry.outputs[0].text


def test_greedy_with_dry_is_the_same_with_and_without_speculation(tiny_llama):
    """Verification sees each draft position's DRY penalty over the drafts before it."""
    from wallbreaker import LLM
    path = str(tiny_llama.gguf_path)
    prompt = {"prompt_token_ids": [11, 12, 13, 14] * 6}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, dry_multiplier=3.0,
                            dry_allowed_length=1, dry_base=1.2, dry_sequence_breakers=[])
    plain = LLM(path, dtype="float32", kv_cache_memory_gb=0.05)
    with_dry = plain.generate([prompt], params)[0].outputs[0].token_ids
    without = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert with_dry != without.outputs[0].token_ids  # the penalty changes this answer
    spec = LLM(path, dtype="float32", kv_cache_memory_gb=0.05, speculative_method="ngram",
               num_speculative_tokens=3, speculative_adaptive=False)
    assert spec.generate([prompt], params)[0].outputs[0].token_ids == with_dry
    assert spec.stats()["spec_proposed"] > 0
