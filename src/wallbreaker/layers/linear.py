"""Linear layers. Weights are built from the stored tensors; projections that run together are fused."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b, with W [out_features, in_features] in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def fused(cls, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> "Linear":
        """One matmul for several projections of the same input (QKV, gate+up)."""
        return cls(torch.cat(weights, dim=0), None if biases is None else torch.cat(biases, dim=0))

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
