"""GPTQ (Frantar et al., 2022): quantize a weight matrix column by column, pushing each column's
rounding error onto the columns not yet quantized through the inverse Hessian of the layer's inputs.

Follows the reference `fasterquant` (also gpt-fast's and AutoGPTQ's): H = 2XXᵀ/n damped by a fraction
of its mean diagonal, the upper Cholesky factor of H⁻¹, lazy updates in blocks of 128 columns, and
optionally activation order (columns by decreasing H diagonal), where the groups are formed in that
order and `g_idx` records each column's group. One difference: a group's scale and zero point are
found on its columns *including* the updates of the block in progress (the reference reads stale
columns when a group starts inside a block).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.grid import QuantGrid, QuantizedTensor


@dataclass(frozen=True)
class GPTQConfig:
    damp: float = 0.01  # fraction of the mean diagonal of H added to it
    block_size: int = 128
    act_order: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.damp < 1:
            raise ValueError(f"damp must be in (0, 1), got {self.damp}")
        if self.block_size < 1:
            raise ValueError("block_size must be positive")


@dataclass
class PreparedHessian:
    """What every weight sharing one input (q, k and v; gate and up) reuses: the column order,
    the inverse Hessian's upper Cholesky factor in that order, and the dead input columns."""

    hinv: torch.Tensor  # [in, in] upper triangular
    perm: torch.Tensor | None  # [in] column order (act order), None: natural
    dead: torch.Tensor  # [in] bool, inputs that were always zero


def prepare_hessian(hessian: torch.Tensor, cfg: GPTQConfig) -> PreparedHessian:
    H = hessian.clone().float()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    perm = torch.argsort(torch.diag(H), descending=True) if cfg.act_order else None
    if perm is not None:
        H = H[perm][:, perm]
    damp = cfg.damp * torch.mean(torch.diag(H))
    idx = torch.arange(H.shape[0])
    for _ in range(6):  # a Hessian that is not positive definite gets more damping
        Hd = H.clone()
        Hd[idx, idx] += damp
        L, info = torch.linalg.cholesky_ex(Hd)
        if info == 0:
            break
        damp *= 10
    else:
        raise ValueError("GPTQ: the Hessian is not positive definite even after damping")
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    return PreparedHessian(hinv, perm, dead)


def gptq_quantize(weight: torch.Tensor, prepared: PreparedHessian, grid: QuantGrid,
                  block_size: int = 128) -> QuantizedTensor:
    """weight [out, in] -> its GPTQ codes on `grid` (groups along the processing order)."""
    W = weight.clone().float()
    W[:, prepared.dead] = 0
    perm = prepared.perm
    if perm is not None:
        W = W[:, perm]
    Hinv = prepared.hinv
    Wt = W.T.contiguous()  # [in, out]: a column of W is a contiguous row here
    cols, rows = Wt.shape
    g = grid.group_size
    block = max(block_size // g, 1) * g if g < block_size else g  # a group never straddles two blocks
    n_groups = -(-cols // g)
    Qt = torch.zeros_like(Wt)  # [in, out] codes, processing order
    scales = torch.zeros(n_groups, rows)
    zeros = torch.zeros(n_groups, rows)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1 = Wt[i1:i2].clone()  # [b, out]
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                s, z = grid.params(W1[i:i + g].T)  # [out]
                scales[col // g], zeros[col // g] = s, z
            w = W1[i]
            q = grid.quantize(w, s, z)
            Qt[col] = q
            err = (w - grid.dequantize(q, s, z)) / Hinv1[i, i]  # [out]
            W1[i:] -= Hinv1[i, i:, None] * err[None, :]
            Err1[i] = err
        Wt[i2:] -= Hinv[i1:i2, i2:].T @ Err1
    Q, scales, zeros = Qt.T.contiguous(), scales.T.contiguous(), zeros.T.contiguous()
    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        g_idx = (inv // g).to(torch.int32)  # column i was processed at position inv[i]
    return QuantizedTensor(Q.to(torch.uint8), scales, None if grid.sym else zeros, grid.bits, g, g_idx)
