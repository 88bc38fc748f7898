"""Round to nearest: each weight to the closest point of its group's grid, no calibration."""
from __future__ import annotations

import torch

from ..formats.grid import QuantGrid, QuantizedTensor


def quantize_rtn(weight: torch.Tensor, grid: QuantGrid) -> QuantizedTensor:
    """Round to nearest on `grid`, groups of consecutive columns (the last one may be shorter)."""
    w = weight.float()
    out, n = w.shape
    g = grid.group_size
    full = n - n % g
    parts = [w[:, :full].reshape(out, full // g, g)] if full else []  # [out, groups, g]
    if full < n:
        parts.append(w[:, full:].unsqueeze(1))  # [out, 1, n - full]
    scales, zeros, codes = [], [], []
    for block in parts:
        s, z = grid.params(block)  # [out, groups]
        scales.append(s)
        zeros.append(z)
        codes.append(grid.quantize(block, s[..., None], z[..., None]).reshape(out, -1))
    return QuantizedTensor(torch.cat(codes, dim=1).to(torch.uint8), torch.cat(scales, dim=1),
                           None if grid.sym else torch.cat(zeros, dim=1), grid.bits, g)
