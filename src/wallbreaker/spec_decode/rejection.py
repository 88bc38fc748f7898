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
    for a deterministic proposer (q one-hot at the draft). Returns (drafts accepted, the next token).

    All K tests at once, as gpt-fast does: one uniform per draft, one pass, one read of the result."""
    k = len(drafts)
    x = torch.tensor(drafts, dtype=torch.long, device=target_probs.device)  # [K]
    rows = torch.arange(k, device=target_probs.device)
    px = target_probs[rows, x]  # [K]
    qx = torch.ones_like(px) if draft_probs is None else draft_probs[rows, x]
    u = torch.rand(k, generator=generator, device="cpu" if generator is None else generator.device).to(px.device)
    accept = (qx > 0) & ((px >= qx) | (u * qx < px))  # [K]
    accepted = int(accept.logical_not().cumsum(0).eq(0).sum())  # the run of acceptances from the first draft
    if accepted == k:
        return k, _draw(target_probs[k], generator)
    p = target_probs[accepted]
    q = _one_hot(drafts[accepted], p) if draft_probs is None else draft_probs[accepted]
    residual = (p - q).clamp_(min=0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: p itself is the residual's limit
        residual = p
    return accepted, _draw(residual, generator)


def _one_hot(x: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[x] = 1.0
    return q


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    if float(probs.max()) >= float(probs.sum()):  # one-hot (greedy): no randomness needed
        return int(probs.argmax())
    return int(sample_from_probs((probs / probs.sum())[None], [generator])[0])
