"""llama.cpp's truncation samplers on probabilities [b, V]: locally typical sampling, XTC and
mirostat 2.0. Each takes the rows that asked for it and leaves the others alone; by hand because
torch and the libraries we use have none of them.

- typical_p (Meister et al., "Locally Typical Sampling"): sort tokens by |-log p - H|, H the
  entropy, and keep the shortest such prefix whose mass exceeds typical_p.
- XTC ("exclude top choices", p-e-w): with probability xtc_probability, every token of probability
  >= xtc_threshold is removed but the least likely of them (when there are at least two). Here as
  the exact mixture of the two outcomes, so that the draw takes one random number, from the
  sequence's own generator: (1 - P) * p + P * p_without_top_choices.
- mirostat 2.0 (Basu et al.): keep the tokens whose surprise -log2 p is at most mu; after the draw
  mu -= eta * (surprise of the drawn token - tau), and that mu is the sequence's state.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def typical_drop(probs: Tensor, typical_p: Tensor) -> Tensor:
    """Mask [b, V] of the tokens typical_p [b] removes from normalized probs [b, V]."""
    logp = probs.log()  # [b, V], -inf where p = 0
    entropy = -(probs * logp.nan_to_num(neginf=0.0)).sum(dim=-1, keepdim=True)  # [b, 1]
    distance = (-logp - entropy).abs()  # [b, V], inf where p = 0
    order = distance.argsort(dim=-1, stable=True)  # most typical first
    mass = probs.gather(1, order).cumsum(dim=-1)  # [b, V]
    # keep through the first token at which the mass exceeds typical_p (at least one)
    keep_sorted = (mass - probs.gather(1, order)) <= typical_p[:, None]
    keep_sorted[:, 0] = True
    return torch.ones_like(probs, dtype=torch.bool).scatter_(1, order, ~keep_sorted)


def xtc_mixture(probs: Tensor, probability: Tensor, threshold: Tensor) -> Tensor:
    """The distribution [b, V] XTC draws from, for normalized probs [b, V]: the mixture of the rows
    unchanged (1 - probability) and of the rows without their top choices (probability)."""
    above = probs >= threshold[:, None]  # [b, V]
    count = above.sum(dim=-1)  # [b]
    # the least likely token above the threshold stays (ties: the highest token id, as a stable
    # descending sort puts it last)
    least = torch.where(above, probs, torch.full_like(probs, 2.0))
    least_p = least.amin(dim=-1, keepdim=True)
    ids = torch.arange(probs.shape[1], device=probs.device)
    last_least = torch.where(above & (probs == least_p), ids, -1).amax(dim=-1, keepdim=True)  # [b, 1]
    removed = above & (ids != last_least) & (count[:, None] >= 2)
    trimmed = probs.masked_fill(removed, 0.0)
    trimmed = trimmed / trimmed.sum(dim=-1, keepdim=True)
    return (1 - probability[:, None]) * probs + probability[:, None] * trimmed


def mirostat_truncate(probs: Tensor, mu: Tensor) -> Tensor:
    """probs [b, V] kept where -log2 p <= mu [b] (the most likely token always), renormalized."""
    keep = probs >= torch.exp2(-mu)[:, None]
    keep |= probs == probs.amax(dim=-1, keepdim=True)
    kept = probs.masked_fill(~keep, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def mirostat_update(mu: float, p_chosen: float, tau: float, eta: float) -> float:
    """mu after a draw of a token of probability p_chosen (in the truncated distribution)."""
    surprise = -math.log2(p_chosen) if p_chosen > 0 else float("inf")
    return mu - eta * (surprise - tau)
