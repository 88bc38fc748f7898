"""AWQ (Lin et al., 2023): protect the weights of salient input channels by scaling them up before
rounding, and the activations down by the same factor.

Per Linear: s = mean|x|^α (normalised to a geometric mean of 1), with α chosen on a grid in [0, 1]
to minimise the output error on calibration inputs, ||X Wᵀ − (X/s) Q(W·s)ᵀ||². α = 0 is plain RTN,
so on the calibration data AWQ is never worse than RTN. The 1/s is folded into the op that produces
X (see `fold.py`), which makes the scaling free at run time.

Then (`clip`, on by default as in llm-awq), as llm-awq's `auto_clip`, each group of each row is
clipped to a shrunk range ±r·max|w| (r from 1 down to 0.5), r chosen per group to minimise that
group's output error. It lowers every Linear's output error on calibration and held-out tokens
alike, yet what that does to perplexity depends on the model (it helps SmolLM2 at 3 bits and hurts
Qwen2.5-Coder-1.5B: docs/awq.md has the figures), hence the switch.

Output errors are measured over every calibration token at once through the inputs' Gram matrix
G = XᵀX/n: the mean squared output error of a weight change Δ [out, in] is Σ (Δ G ⊙ Δ) / out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..formats.grid import QuantGrid
from .rtn import quantize_rtn


@dataclass(frozen=True)
class AWQConfig:
    n_grid: int = 20  # α in {0, 1/n_grid, ..., 1}
    clip: bool = True
    clip_grid: int = 20  # r in {1, 1 − 1/clip_grid, ..., 1 − max_shrink}
    max_shrink: float = 0.5

    def __post_init__(self) -> None:
        if self.n_grid < 1 or self.clip_grid < 1:
            raise ValueError("n_grid and clip_grid must be at least 1")
        if not 0 <= self.max_shrink < 1:
            raise ValueError("max_shrink must be in [0, 1)")


@dataclass
class ScaleSearch:
    scales: torch.Tensor  # [in]
    alpha: float
    error: float  # mean squared output error at the best α
    rtn_error: float  # ... at α = 0 (plain RTN)


def output_error(delta: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Mean squared output error of each row of a weight change delta [out, in]: [out]."""
    return ((delta @ gram) * delta).sum(-1)


def search_scales(gram: torch.Tensor, mean_abs: torch.Tensor, weight: torch.Tensor, grid: QuantGrid,
                  cfg: AWQConfig = AWQConfig(),
                  tie: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ScaleSearch:
    """gram [in, in] = XᵀX/n and mean_abs [in] of the calibration inputs, weight [out, in]. `tie` maps a
    per-channel vector to one whose channels are equal where the fold needs them equal."""
    w = weight.float()
    stat = mean_abs.float().clamp(min=1e-8)
    if tie is not None:
        stat = tie(stat)
    best: tuple[float, float, torch.Tensor] | None = None
    rtn_error = float("nan")
    for k in range(cfg.n_grid + 1):
        alpha = k / cfg.n_grid
        s = stat.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = quantize_rtn(w * s, grid).dequantize() / s  # [out, in]
        err = output_error(wq - w, gram).mean().item()
        if k == 0:
            rtn_error = err
        if best is None or err < best[0]:
            best = (err, alpha, s)
    assert best is not None
    return ScaleSearch(best[2], best[1], best[0], rtn_error)


def search_clip(gram: torch.Tensor, weight: torch.Tensor, grid: QuantGrid, cfg: AWQConfig = AWQConfig()) -> torch.Tensor:
    """weight [out, in] -> the weight with each row's groups clipped to their best range."""
    w = weight.float().clone()
    g = grid.group_size
    for start in range(0, w.shape[1], g):
        wg, gg = w[:, start:start + g], gram[start:start + g, start:start + g]  # [out, gs], [gs, gs]
        one_group = QuantGrid(grid.bits, wg.shape[1], grid.sym)
        top = wg.abs().amax(dim=1)  # [out]
        best_err = torch.full_like(top, float("inf"))
        best = wg.clone()
        for k in range(int(cfg.max_shrink * cfg.clip_grid) + 1):
            bound = (top * (1 - k / cfg.clip_grid))[:, None]
            clipped = torch.maximum(torch.minimum(wg, bound), -bound)
            err = output_error(quantize_rtn(clipped, one_group).dequantize() - wg, gg)  # [out]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best[better] = clipped[better]
        w[:, start:start + g] = best
    return w
