"""Group-wise integer grids: every method (RTN, GPTQ, AWQ, mixed) ends in these codes and parameters.

A weight w in group g of its row is stored as a code q in 0..2^bits − 1 and read back as

    w ≈ (q − z_g) · s_g

with one scale s_g (and, when asymmetric, one zero point z_g) per `group_size` consecutive inputs of a
row, or per group of columns named by `g_idx` (GPTQ's activation order).

- symmetric: s = m / −2^(bits−1), m the group's value of largest magnitude (with its sign), and
  z = 2^(bits−1), so that m is exactly the code 0: GGUF's Q4_0 grid, which uses all 2^bits levels.
  At 4 bits with group 32 this *is* Q4_0, at 8 bits Q8_0 (int8 = q − 128).
- asymmetric: s = (max − min) / (2^bits − 1), z = −min / s (a float zero point): GGUF's Q4_1 grid.

Scales and zero points are rounded to float16 as soon as they are found, and every code is chosen
against the rounded values, so that what a method optimised is exactly what a file stores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PARAM_DTYPE = torch.float16


@dataclass(frozen=True)
class QuantGrid:
    bits: int
    group_size: int = 128
    sym: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be between 2 and 8, got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be positive, got {self.group_size}")

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    @property
    def sym_zero(self) -> float:
        return float(1 << (self.bits - 1))

    def params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point of each row of `w` [..., n] over its last dim: ([...], [...])."""
        w = w.float()
        if self.sym:
            idx = w.abs().argmax(dim=-1, keepdim=True)
            m = w.gather(-1, idx).squeeze(-1)
            scale = m / -self.sym_zero
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)
            return _round(scale), torch.full_like(scale, self.sym_zero)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = (hi - lo) / self.maxq
        scale = _round(torch.where(scale == 0, torch.ones_like(scale), scale))
        return scale, _round(-lo / scale)

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Codes of `w` on a grid (broadcasting): float tensor of integers in 0..maxq."""
        return torch.clamp(torch.round(w / scale + zero), 0, self.maxq)

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return (q - zero) * scale


def _round(x: torch.Tensor) -> torch.Tensor:
    return x.to(PARAM_DTYPE).float()


@dataclass
class QuantizedTensor:
    """One quantized weight matrix [out, in] in unpacked form (see `packing.py` for the stored form)."""

    codes: torch.Tensor  # [out, in] uint8, 0..2^bits − 1
    scales: torch.Tensor  # [out, n_groups] float32 holding float16 values
    zeros: torch.Tensor | None  # [out, n_groups]; None when symmetric (z = 2^(bits−1))
    bits: int
    group_size: int
    g_idx: torch.Tensor | None = None  # [in] int32 group of each input column; None: column // group_size

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def sym(self) -> bool:
        return self.zeros is None

    @property
    def grid(self) -> QuantGrid:
        return QuantGrid(self.bits, self.group_size, self.sym)

    def group_index(self) -> torch.Tensor:
        """[in] long: the group of every input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.codes.shape[1]) // self.group_size

    def zero_points(self) -> torch.Tensor:
        if self.zeros is not None:
            return self.zeros
        return torch.full_like(self.scales, self.grid.sym_zero)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: (q − z[g]) · s[g]."""
        g = self.group_index()
        return QuantGrid.dequantize(self.codes.float(), self.scales[:, g], self.zero_points()[:, g])

    def rows(self, start: int, stop: int) -> "QuantizedTensor":
        """The rows [start, stop): one projection out of a fused matrix."""
        zeros = None if self.zeros is None else self.zeros[start:stop]
        return QuantizedTensor(self.codes[start:stop], self.scales[start:stop], zeros, self.bits,
                               self.group_size, self.g_idx)
