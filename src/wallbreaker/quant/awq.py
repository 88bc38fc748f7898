"""AWQ (Lin et al., 2023): protect the weights of salient input channels by scaling them up before
rounding, and the activations down by the same factor.

Per Linear: s = mean|x|^α (normalised to a geometric mean of 1), with α chosen on a grid in [0, 1]
to minimise the output error on calibration inputs, ||X Wᵀ − (X/s) Q(W·s)ᵀ||². α = 0 is plain RTN,
so on the calibration rows AWQ is never worse than RTN. The 1/s is folded into the op that produces
X (see `fold.py`), which makes the scaling free at run time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .grid import QuantGrid
from .rtn import quantize_rtn


@dataclass(frozen=True)
class AWQConfig:
    n_grid: int = 20  # α in {0, 1/n_grid, ..., 1}
    max_rows: int = 4096  # calibration rows the output error is measured on

    def __post_init__(self) -> None:
        if self.n_grid < 1:
            raise ValueError("n_grid must be at least 1")


@dataclass
class ScaleSearch:
    scales: torch.Tensor  # [in]
    alpha: float
    error: float  # mean squared output error at the best α
    rtn_error: float  # ... at α = 0 (plain RTN)


def search_scales(x: torch.Tensor, weight: torch.Tensor, grid: QuantGrid, cfg: AWQConfig = AWQConfig(),
                  mean_abs: torch.Tensor | None = None,
                  tie: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ScaleSearch:
    """x [n, in] calibration inputs, weight [out, in]. `mean_abs` [in] defaults to x's; `tie` maps
    a per-channel vector to one whose channels are equal where the fold needs them equal."""
    x = x[: cfg.max_rows].float()
    w = weight.float()
    stat = (mean_abs if mean_abs is not None else x.abs().mean(0)).float().clamp(min=1e-8)
    if tie is not None:
        stat = tie(stat)
    ref = x @ w.T  # [n, out]
    best: tuple[float, float, torch.Tensor] | None = None
    rtn_error = float("nan")
    for k in range(cfg.n_grid + 1):
        alpha = k / cfg.n_grid
        s = stat.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = quantize_rtn(w * s, grid).dequantize() / s  # [out, in]
        err = (x @ wq.T - ref).pow(2).mean().item()
        if k == 0:
            rtn_error = err
        if best is None or err < best[0]:
            best = (err, alpha, s)
    assert best is not None
    return ScaleSearch(best[2], best[1], best[0], rtn_error)
