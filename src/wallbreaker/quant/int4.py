"""Group-wise 4-bit weights in the form PyTorch's CPU int4 kernel reads: w = (q - 8) * scale + zero,
q in 0..15, one (scale, zero) per group of `group_size` weights along a row.

GGUF's 4-bit block formats map onto it exactly (up to the kernel's bfloat16 scales):
Q4_0 w = d(q - 8): scale d, zero 0; Q4_1 w = dq + m: scale d, zero m + 8d;
Q4_K w = d·sc·q − dmin·m per 32-weight sub-block: scale d·sc, zero 8·d·sc − dmin·m.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from ..formats.dequant import _bits, _half_at, _k_scale_min, _nibbles, tensor_nbytes

T = gguf.GGMLQuantizationType
GGUF_INT4_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})


@dataclass
class Int4Groups:
    codes: torch.Tensor  # [out, in] uint8, 0..15
    scale: torch.Tensor  # [out, in / group_size] float32
    zero: torch.Tensor  # [out, in / group_size] float32
    group_size: int

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        out, inp = self.codes.shape
        q = self.codes.float().view(out, inp // g, g) - 8
        return (q * self.scale[..., None] + self.zero[..., None]).view(out, inp)

    def map_rows(self, fn) -> "Int4Groups":
        return Int4Groups(fn(self.codes), fn(self.scale), fn(self.zero), self.group_size)

    def narrow(self, dim: int, lo: int, hi: int) -> "Int4Groups | None":
        """Rows (dim 0) or columns (dim 1) lo..hi; None when a column boundary falls inside a group."""
        if dim == 0:
            return self.map_rows(lambda x: x[lo:hi])
        g = self.group_size
        if lo % g or hi % g:
            return None
        return Int4Groups(self.codes[:, lo:hi].contiguous(), self.scale[:, lo // g:hi // g].contiguous(),
                          self.zero[:, lo // g:hi // g].contiguous(), g)

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        assert len({p.group_size for p in parts}) == 1
        return Int4Groups(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), parts[0].group_size)


def int4_from_gguf(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> Int4Groups:
    qtype = T(qtype)
    rows, cols = shape
    data = torch.from_numpy(np.array(raw).reshape(-1)[: tensor_nbytes(qtype, shape)])
    if qtype == T.Q4_K:
        blocks = data.view(-1, 144)
        n = blocks.shape[0]
        q = _bits(blocks[:, 16:].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 256)
        sc, mn = _k_scale_min(blocks[:, 4:16])
        scale = _half_at(blocks, 0) * sc  # [n, 8]
        zero = 8 * scale - _half_at(blocks, 2) * mn
    else:
        size = 18 if qtype == T.Q4_0 else 20
        blocks = data.view(-1, size)
        q = _nibbles(blocks[:, size - 16:])  # [n, 32]
        scale = _half_at(blocks, 0)  # [n, 1]
        zero = torch.zeros_like(scale) if qtype == T.Q4_0 else _half_at(blocks, 2) + 8 * scale
    return Int4Groups(q.reshape(rows, cols), scale.reshape(rows, cols // 32), zero.reshape(rows, cols // 32), 32)
