"""Plain-Python references of llama.cpp's samplers, written from their published descriptions (not
from our torch code), and a chi-square check, for tests/test_dry.py and tests/test_truncation.py."""
from __future__ import annotations

import math
import random
from collections import Counter

import torch

from wallbreaker.layers.sampler import sample
from wallbreaker.sampling_params import SamplingParams


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    e = [math.exp(v - top) if v != -math.inf else 0.0 for v in logits]
    s = sum(e)
    return [x / s for x in e]


def normalized(p: list[float]) -> list[float]:
    s = sum(p)
    return [x / s for x in p]


def dry_reference(context: list[int], vocab: int, multiplier: float, base: float, allowed: int,
                  breakers: set[int]) -> list[float]:
    """Penalty per token: for each earlier position j, the longest n with context[j-n:j] equal to the
    context's last n tokens, not reaching back past the last breaker; token context[j] would extend
    that repetition to n + 1. Breaker tokens are never penalized."""
    L = len(context)
    since_breaker = next((i for i, t in enumerate(reversed(context)) if t in breakers), L)
    penalty = [0.0] * vocab
    best: dict[int, int] = {}
    for j in range(1, L):
        n = 0
        while n < j and context[j - 1 - n] == context[L - 1 - n]:
            n += 1
        n = min(n, since_breaker)
        if n >= allowed and n > best.get(context[j], -1):
            best[context[j]] = n
    for t, n in best.items():
        if t not in breakers:
            penalty[t] = multiplier * base ** (n - allowed)
    return penalty


def typical_reference(p: list[float], mass: float) -> list[float]:
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    order = sorted(range(len(p)), key=lambda i: abs(-math.log(p[i]) - entropy) if p[i] > 0 else math.inf)
    kept, total = [], 0.0
    for i in order:
        kept.append(i)
        total += p[i]
        if total > mass:
            break
    return normalized([p[i] if i in kept else 0.0 for i in range(len(p))])


def xtc_reference(p: list[float], probability: float, threshold: float) -> list[float]:
    """The law of XTC's draw: with `probability`, the tokens at or above the threshold are removed but
    the least likely of them (if there are two or more); otherwise nothing changes."""
    above = sorted((i for i in range(len(p)) if p[i] >= threshold), key=lambda i: (p[i], -i))
    if len(above) < 2:
        return p
    removed = set(above[1:])
    cut = normalized([0.0 if i in removed else x for i, x in enumerate(p)])
    return [(1 - probability) * a + probability * b for a, b in zip(p, cut)]


def mirostat_reference(p: list[float], mu: float) -> list[float]:
    """Mirostat 2.0's truncation: sorted by probability, keep until the first token whose surprise
    -log2 p exceeds mu (at least one)."""
    order = sorted(range(len(p)), key=lambda i: -p[i])
    kept = [order[0]] + [i for i in order[1:] if p[i] > 0 and -math.log2(p[i]) <= mu]
    return normalized([p[i] if i in kept else 0.0 for i in range(len(p))])


def first_token_counts(logits: torch.Tensor, params: SamplingParams, n: int,
                       context: list[int] | None = None, breakers: frozenset[int] = frozenset()) -> Counter:
    """n draws of one row, each row of the batch with its own seeded generator (seeds spread by a
    hash: the first draws of neighbouring seeds are not independent enough for a chi-square test)."""
    batch = logits.expand(n, -1).clone()
    gens = [torch.Generator().manual_seed(random.Random(i).getrandbits(62)) for i in range(n)]
    ctx = context or []
    out = sample(batch, [params] * n, [ctx] * n, [[] for _ in range(n)], gens,
                 dry_breakers=[breakers] * n)
    return Counter(out.token_ids.tolist())


def chi_square_rejects(counts: Counter, probs: list[float], n: int) -> bool:
    """Pearson's chi-square of counts against probs, rare outcomes pooled; True if p < 0.001.
    A token of probability 0 that was drawn rejects outright."""
    if any(counts[t] for t, pr in enumerate(probs) if pr == 0):
        return True
    common = [t for t, pr in enumerate(probs) if pr * n >= 5]
    stat = sum((counts[t] - probs[t] * n) ** 2 / (probs[t] * n) for t in common)
    rest_p = 1 - sum(probs[t] for t in common)
    rest_c = n - sum(counts[t] for t in common)
    dof = len(common) - 1
    if rest_p * n >= 5:
        stat += (rest_c - rest_p * n) ** 2 / (rest_p * n)
        dof += 1
    if dof <= 0:
        return stat > 0
    z = 3.0902  # Wilson-Hilferty: the chi-square quantile at 1 - 0.001
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat > critical
