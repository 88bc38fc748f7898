"""Modified rejection sampling (Leviathan et al.; Chen et al.): keeps the target's distribution exactly.

Drafted token x_j (drawn from q_j) is accepted with probability min(1, p_j(x) / q_j(x)). At the first
rejection the replacement is drawn from normalize(max(0, p_j − q_j)); if all K pass, a bonus token is
drawn from p_K. With greedy settings p is one-hot at the argmax, so this keeps the longest prefix that
equals the target's argmax and then takes the argmax: the same tokens as plain greedy decoding.
"""
from __future__ import annotations

import torch

from ..layers.sampler import sample_from_probs


def verify(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, drafts: list[int],
           generator: torch.Generator | None) -> tuple[int, int]:
    """target_probs: [K + 1, V] (row j scores the token after draft j − 1); draft_probs: [K, V], or None
    for a deterministic proposer (q one-hot at the draft). Returns (drafts accepted, the next token)."""
    k = len(drafts)
    for j, x in enumerate(drafts):
        p = target_probs[j]
        q = _one_hot(x, p) if draft_probs is None else draft_probs[j]
        px, qx = float(p[x]), float(q[x])
        if qx > 0 and (px >= qx or _uniform(generator) * qx < px):
            continue
        residual = (p - q).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: p itself is the residual's limit
            residual = p
        return j, _draw(residual, generator)
    return k, _draw(target_probs[k], generator)


def _one_hot(x: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[x] = 1.0
    return q


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    if float(probs.max()) >= float(probs.sum()):  # one-hot (greedy): no randomness needed
        return int(probs.argmax())
    return int(sample_from_probs((probs / probs.sum())[None], [generator])[0])
