import math

import pytest
import torch

from wallbreaker.layers import sampler
from wallbreaker.layers.sampler import apply_penalties, processed_probs, sample, sample_from_probs
from wallbreaker.sampling_params import SamplingParams

V = 32
N_DRAWS = 2000


def logits_for(seed: int, rows: int = 1, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2  # [rows, V]


def empty(rows: int) -> list[list[int]]:
    return [[] for _ in range(rows)]


def draws(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """N_DRAWS samples of one row (as a batch of copies) and the distribution they come from."""
    batch = logits.expand(N_DRAWS, -1).clone()
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        out = sample(batch, [params] * N_DRAWS, empty(N_DRAWS), empty(N_DRAWS), [None] * N_DRAWS)
    probs = processed_probs(logits, [params], [[]], [[]])[0]
    return out.token_ids, probs


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=probs.numel()).float() / tokens.numel()
    return 0.5 * (freq - probs).abs().sum().item()


def test_greedy_is_argmax_and_leaves_generators_alone():
    logits = logits_for(0, rows=4)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    states = [g.get_state() for g in gens]
    global_state = torch.get_rng_state()
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 4
    out = sample(logits, params, empty(4), empty(4), gens[:2] + [None, None])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))
    assert torch.equal(torch.get_rng_state(), global_state)
    probs = processed_probs(logits, params, empty(4), empty(4))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())


def test_greedy_uses_penalized_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    p = SamplingParams(temperature=0, presence_penalty=1.0)
    out = sample(logits, [p], [[]], [[0]], [None])
    assert out.token_ids.tolist() == [1]
    assert processed_probs(logits, [p], [[]], [[0]]).tolist() == [[0.0, 1.0, 0.0]]


def run_steps(params: list[SamplingParams], seeds: list[int | None], steps: int = 50) -> list[list[int]]:
    """Decode `steps` tokens per row with feedback into the penalties; row i's logits depend on (i's seed, step)."""
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    prompts = [[1, 2, 3]] * len(params)
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(steps):
        logits = torch.cat([logits_for(1000 * step + (s or 0), vocab=64) for s in seeds])
        out = sample(logits, params, prompts, outputs, gens)
        for row, t in zip(outputs, out.token_ids.tolist()):
            row.append(t)
    return outputs


def test_seeded_row_is_reproducible_and_independent_of_the_batch():
    mine = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=7)
    alone = run_steps([mine], [7])[0]
    assert alone == run_steps([mine], [7])[0]
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(min_p=0.2, frequency_penalty=0.5),
        SamplingParams(temperature=0.5, top_p=0.5, top_k=10, presence_penalty=1.0),
        SamplingParams(),
        SamplingParams(seed=7),
        SamplingParams(temperature=2.0, min_p=0.05),
    ]
    batch = [others[0], others[1], mine, *others[2:]]
    seeds = [None, 3, 7, None, 11, None, 7, None]
    assert len(batch) == 8
    with torch.random.fork_rng():
        torch.manual_seed(99)
        in_batch = run_steps(batch, seeds)
    assert in_batch[2] == alone
    # A plain seeded row skips the sort when alone but not in this batch: same tokens anyway.
    assert in_batch[6] == run_steps([others[5]], [7])[0]
    assert len(set(alone)) > 5  # really sampled, not stuck on one token


def allowed_by_hand(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Support of the filtered distribution, computed with plain Python."""
    vals = [v / params.temperature for v in logits.tolist()]
    order = sorted(range(len(vals)), key=lambda i: (-vals[i], i))
    keep = order
    if params.top_k > 0:
        kth = vals[order[params.top_k - 1]]
        keep = [i for i in order if vals[i] >= kth]
    z = sum(math.exp(vals[i]) for i in keep)
    p = {i: math.exp(vals[i]) / z for i in keep}
    if params.top_p < 1:
        kept, mass = [], 0.0
        for i in keep:
            kept.append(i)
            mass += p[i]
            if mass >= params.top_p:
                break
        keep = kept
    pmax = max(p[i] for i in keep)
    return {i for i in keep if p[i] >= params.min_p * pmax}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.6, temperature=0.7),
        SamplingParams(min_p=0.1, temperature=1.5),
        SamplingParams(top_k=10, top_p=0.8, min_p=0.05),
        SamplingParams(),
    ],
    ids=["top_k", "top_p", "min_p", "all", "plain"],
)
def test_filters_respect_their_support_and_distribution(params):
    logits = logits_for(5)
    tokens, probs = draws(logits, params)
    allowed = allowed_by_hand(logits[0], params)
    assert set(torch.nonzero(probs).flatten().tolist()) == allowed
    assert set(tokens.tolist()) <= allowed
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)
    kept = torch.tensor(sorted(allowed))
    expected = torch.softmax(logits[0, kept] / params.temperature, dim=-1)
    assert torch.allclose(probs[kept], expected, atol=1e-6)
    assert total_variation(tokens, probs) < 0.05


def test_top_k_gives_the_same_probs_whatever_the_batch():
    """top-k goes through `topk`, or through the full sort when another row wants top-p."""
    logits = logits_for(6, rows=2)
    logits[0, :4] = logits[0].max() + 1  # a tie at the top-k boundary
    k_only = SamplingParams(top_k=3)
    alone = processed_probs(logits[:1], [k_only], [[]], [[]])
    mixed = processed_probs(logits, [k_only, SamplingParams(top_p=0.5)], empty(2), empty(2))
    assert torch.equal(alone[0], mixed[0])
    assert (alone[0] > 0).sum().item() == 4
    plain = SamplingParams()
    with_plain = processed_probs(logits, [k_only, plain], empty(2), empty(2))
    assert torch.equal(with_plain[0], alone[0])
    assert torch.equal(with_plain[1], processed_probs(logits[1:], [plain], [[]], [[]])[0])


@pytest.mark.parametrize("candidates", [1, 3, 8])
def test_top_p_candidate_shortcut_matches_the_full_sort(monkeypatch, candidates):
    """Rows whose nucleus fits in the candidates and rows that fall back to a full sort."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.round(torch.randn(12, 40, generator=gen) * 2)  # [12, 40], many ties
    logits[:4] *= 4  # peaky rows: small nucleus
    params = [SamplingParams(top_p=p, top_k=k) for p, k in zip([0.3, 0.6, 0.9, 0.99] * 3, [0, 0, 0, 7] * 3)]
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", candidates)
    short = processed_probs(logits, params, empty(12), empty(12))
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", 10**9)
    full = processed_probs(logits, params, empty(12), empty(12))
    assert torch.equal(short, full)
    for row, p in enumerate(params):
        assert set(torch.nonzero(full[row]).flatten().tolist()) == allowed_by_hand(logits[row], p)


def test_top_p_ties_straddling_the_candidates_go_to_the_lowest_ids(monkeypatch):
    logits = torch.zeros(1, 40)
    logits[0, 20] = 3.0  # p = 0.34, then 39 tokens tied at p = 0.017
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", 4)  # topk keeps arbitrary tied ids
    probs = processed_probs(logits, [SamplingParams(top_p=0.365)], [[]], [[]])
    assert torch.nonzero(probs[0]).flatten().tolist() == [0, 1, 20]


def test_top_p_keeps_at_least_one_token():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    probs = processed_probs(logits, [SamplingParams(top_p=1e-6)], [[]], [[]])
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_sample_from_probs_is_exact():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.cat([sample_from_probs(probs.expand(200, -1), [gen] * 200) for _ in range(20)])
    counts = torch.bincount(tokens, minlength=5).float()
    assert counts[4] == 0
    expected = probs[:4] * tokens.numel()
    chi2 = ((counts[:4] - expected) ** 2 / expected).sum().item()
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def test_penalties_match_hand_computed_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    prompt, output = [[0, 1]], [[2, 2, 4]]
    got = apply_penalties(logits, params, prompt, output)
    # repetition on prompt + output {0, 1, 2, 4}: positive / 2, negative * 2
    # presence + frequency on output only: 2 -> 0.5 + 2 * 0.25, 4 -> 0.5 + 0.25
    want = torch.tensor([[1.0, -2.0, 0.25 - 1.0, 3.0, -4.0 - 0.75, 1.0]])
    assert torch.allclose(got, want)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]))


def test_repeat_last_n_narrows_the_penalties_to_the_last_tokens():
    """llama.cpp's window: the repetition penalty sees the last n tokens of prompt + output, presence
    and frequency the output tokens among them; 0 sees none, -1 (the default) all."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    prompt, output = [[0, 1, 3]], [[2, 2, 4]]

    def penalized(n: int) -> torch.Tensor:
        params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, repeat_last_n=n)]
        return apply_penalties(logits, params, prompt, output)

    def reference(n: int) -> torch.Tensor:
        context = prompt[0] + output[0]
        window = context[len(context) - n:] if n > 0 else ([] if n == 0 else context)
        in_output = window[max(0, len(window) - len(output[0])):]
        want = logits.clone()
        for t in set(window):
            want[0, t] = want[0, t] / 2.0 if want[0, t] > 0 else want[0, t] * 2.0
        for t in set(in_output):
            want[0, t] -= 0.25 * in_output.count(t)
        return want

    for n in (-1, 0, 1, 2, 4, 6, 50):
        assert torch.allclose(penalized(n), reference(n)), n
    assert not torch.allclose(penalized(2), penalized(-1))
    with pytest.raises(ValueError, match="repeat_last_n"):
        SamplingParams(repeat_last_n=-2)


def test_penalties_are_per_row():
    logits = torch.ones(3, 4)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams(repetition_penalty=4.0)]
    got = apply_penalties(logits, params, [[0], [0], [0]], [[1, 1], [1, 1], [3]])
    assert got.tolist() == [[1, 1, 1, 1], [1, -1, 1, 1], [0.25, 1, 1, 0.25]]


def test_logprobs_are_raw_log_softmax():
    logits = logits_for(8, rows=3)
    params = [SamplingParams(temperature=0.5, top_k=2, repetition_penalty=1.5, logprobs=5),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(top_p=0.3)]
    out = sample(logits, params, [[0, 1]] * 3, empty(3), [torch.Generator().manual_seed(1), None, None])
    raw = torch.log_softmax(logits, dim=-1)
    # rows that asked get the raw log-softmax; the third did not ask and gets 0.0
    assert torch.allclose(out.logprobs[:2], raw.gather(1, out.token_ids[:, None]).squeeze(1)[:2])
    assert out.logprobs[2] == 0.0
    top = out.top_logprobs
    assert top is not None and len(top[0]) == 5 and top[1] == [] and top[2] == []
    assert [lp for _, lp in top[0]] == sorted((lp for _, lp in top[0]), reverse=True)
    for tid, lp in top[0]:
        assert lp == pytest.approx(raw[0, tid].item())
    assert top[0][0][0] == logits[0].argmax().item()


def test_top_logprobs_none_when_nobody_asks():
    out = sample(logits_for(9, rows=2), [SamplingParams()] * 2, empty(2), empty(2), [None, None])
    assert out.top_logprobs is None
    assert out.token_ids.dtype == torch.long and out.token_ids.shape == (2,)
