"""typical_p, XTC and mirostat 2.0 (layers/truncation.py) through the sampler, against plain-Python
references of the published algorithms; and every llama.cpp sampler's seeded reproducibility."""
import math

import pytest
import torch
from llama_sampler_reference import (chi_square_rejects, first_token_counts, mirostat_reference, softmax,
                                     typical_reference, xtc_reference)

from wallbreaker.layers.sampler import processed_probs, sample
from wallbreaker.sampling_params import SamplingParams

V = 16
N_DRAWS = 3000


def peaked_logits(seed: int) -> torch.Tensor:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 1.5
    logits[0, 2] += 2.5  # a few clear top choices, so that XTC and the truncations have work
    logits[0, 7] += 2.0
    return logits


CASES = {
    "typical_p": (SamplingParams(typical_p=0.5), lambda p: typical_reference(p, 0.5)),
    "xtc": (SamplingParams(xtc_probability=0.6, xtc_threshold=0.1), lambda p: xtc_reference(p, 0.6, 0.1)),
    "xtc_always": (SamplingParams(xtc_probability=1.0, xtc_threshold=0.05), lambda p: xtc_reference(p, 1.0, 0.05)),
    "mirostat": (SamplingParams(mirostat_mode=2, mirostat_tau=1.5), lambda p: mirostat_reference(p, 3.0)),
}


@pytest.mark.parametrize("name", CASES)
def test_first_token_distribution_matches_the_reference(name):
    params, reference = CASES[name]
    logits = peaked_logits(1)
    p = softmax(logits[0].tolist())
    want = reference(p)
    assert want != pytest.approx(p)  # the sampler changes the law here, so the check can fail
    counts = first_token_counts(logits, params, N_DRAWS)
    assert not chi_square_rejects(counts, want, N_DRAWS)
    assert chi_square_rejects(counts, p, N_DRAWS)
    # the law the speculative verifier uses is the same one
    got = processed_probs(logits, [params], [[]], [[]])[0].tolist()
    assert got == pytest.approx(want, abs=1e-6)


def test_xtc_leaves_a_single_top_choice_alone():
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0]])  # only token 0 is above the threshold
    got = processed_probs(logits, [SamplingParams(xtc_probability=1.0, xtc_threshold=0.2)], [[]], [[]])
    assert got[0].tolist() == pytest.approx(softmax(logits[0].tolist()))


def test_xtc_threshold_above_one_half_disables_it():
    logits = peaked_logits(2)
    got = processed_probs(logits, [SamplingParams(xtc_probability=1.0, xtc_threshold=0.6)], [[]], [[]])
    assert got[0].tolist() == pytest.approx(softmax(logits[0].tolist()))


def test_mirostat_state_follows_the_published_update():
    logits = peaked_logits(3)
    params = SamplingParams(mirostat_mode=2, mirostat_tau=2.0, mirostat_eta=0.3, seed=1)
    mu = 4.0
    out = sample(logits, [params], [[]], [[]], [torch.Generator().manual_seed(1)], mirostat_mu=[mu])
    token = out.token_ids.item()
    truncated = mirostat_reference(softmax(logits[0].tolist()), mu)
    surprise = -math.log2(truncated[token])
    assert out.mirostat_mu[0] == pytest.approx(mu - 0.3 * (surprise - 2.0), rel=1e-5)
    # rows without mirostat carry no state
    plain = sample(logits, [SamplingParams()], [[]], [[]], [None])
    assert plain.mirostat_mu is None


def run_steps(params: list[SamplingParams], seeds: list[int | None], steps: int = 40) -> list[list[int]]:
    """Decode `steps` tokens per row, feeding back the outputs (DRY) and the mirostat state."""
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    prompts = [[1, 2, 3, 1, 2]] * len(params)
    outputs: list[list[int]] = [[] for _ in params]
    mus: list[float | None] = [None] * len(params)
    for step in range(steps):
        logits = torch.cat([torch.randn(1, 64, generator=torch.Generator().manual_seed(1000 * step + (s or 0)))
                            for s in seeds])
        out = sample(logits, params, prompts, outputs, gens, dry_breakers=[frozenset({0})] * len(params),
                     mirostat_mu=mus)
        for row, t in zip(outputs, out.token_ids.tolist()):
            row.append(t)
        if out.mirostat_mu is not None:
            mus = [m if m is not None else old for m, old in zip(out.mirostat_mu, mus)]
    return outputs


SEEDED = [
    SamplingParams(seed=7, dry_multiplier=0.8, dry_allowed_length=1),
    SamplingParams(seed=7, xtc_probability=0.5, xtc_threshold=0.05),
    SamplingParams(seed=7, typical_p=0.7),
    SamplingParams(seed=7, mirostat_mode=2, mirostat_tau=3.0, mirostat_eta=0.2),
]


@pytest.mark.parametrize("mine", SEEDED, ids=["dry", "xtc", "typical_p", "mirostat"])
def test_every_sampler_is_reproducible_with_a_seed_whatever_the_batch(mine):
    alone = run_steps([mine], [7])[0]
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, xtc_probability=1.0, xtc_threshold=0.02),
              SamplingParams(typical_p=0.3, dry_multiplier=2.0), SamplingParams(mirostat_mode=2, mirostat_tau=1.0),
              SamplingParams(seed=3, top_p=0.5)]
    with torch.random.fork_rng():
        torch.manual_seed(99)
        in_batch = run_steps([others[0], others[1], mine, *others[2:]], [None, None, 7, None, None, 3])
    assert in_batch[2] == alone
    assert len(set(alone)) > 5  # really sampled
