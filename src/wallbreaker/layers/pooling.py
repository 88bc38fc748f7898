"""Pooling: one sequence's hidden states -> one vector (an embedding) or a classifier's logits.

The runner hands the pooler each pooling sequence's rows of the step's hidden states; a pooling
sequence is always computed whole in one step (the scheduler sees to it), so its rows are all its
tokens. What a request then makes of the vector (Matryoshka `dimensions`, normalization, a score's
sigmoid) is `finish_embedding` / `finish_score`, outside the engine.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import PoolingConfig
from ..pooling_params import PoolingParams


def pool_rows(hidden: torch.Tensor, method: str) -> torch.Tensor:
    """[tokens, hidden] of one sequence -> [hidden] float32."""
    if method == "mean":
        return hidden.float().mean(dim=0)
    if method == "cls":
        return hidden[0].float()
    return hidden[-1].float()


class Pooler(nn.Module):
    """The model's pooling, and the head after it where the model has one: a classifier
    (`head`, hidden -> num_labels logits)."""

    def __init__(self, config: PoolingConfig, head: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.head = head

    def forward(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """hidden [T, H]; spans (start, length) of each pooling sequence -> one float32 vector each."""
        if not spans:
            return []
        pooled = torch.stack([pool_rows(hidden[s:s + n], self.config.method) for s, n in spans])  # [N, H]
        if self.head is not None:
            pooled = self.head(pooled).float()
        return list(pooled)


def finish_embedding(vector: torch.Tensor, config: PoolingConfig, params: PoolingParams) -> list[float]:
    """The pooled vector as the request wants it: cut to `dimensions` (Matryoshka), then normalized
    where the model normalizes (or the request says so)."""
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    if normalize:
        vector = F.normalize(vector.float(), dim=-1)
    return vector.tolist()


def finish_score(logits: torch.Tensor, config: PoolingConfig) -> float:
    """A cross-encoder's relevance in [0, 1]: the sigmoid of its one logit (sentence-transformers'
    CrossEncoder and vLLM's /score do the same); with more labels, the last label's probability."""
    if logits.numel() == 1:
        return float(torch.sigmoid(logits.float()).reshape(()))
    return float(torch.softmax(logits.float(), dim=-1)[-1])  # the last label's probability

