import torch
import torch.nn.functional as F
from torch import nn

from .. import _C
from .direct import DirectModule

_add_rms_norm_ = _C.add_rms_norm_


class RMSNorm(DirectModule):
    """RMS normalization in float32; `weight` is the effective multiplier (Gemma's 1 + w is folded in at load)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """h += delta (h float32, in place), then the norm of h: one pass, where a residual add meets
        the next norm. Without a delta, just the norm."""
        if delta is None:
            return self.forward(h)
        return _add_rms_norm_(h, delta, self.weight, self.eps)
