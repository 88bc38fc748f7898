"""Token embedding: a float table, or the stored GGUF blocks with only the looked-up rows dequantized
(a 262k-row vocabulary stays at its stored size)."""
from __future__ import annotations

import gguf
import numpy as np
import torch
from torch import nn

from ..formats.dequant import dequantize


class Embedding(nn.Module):
    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(table, requires_grad=False)  # [vocab, hidden]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class QuantizedEmbedding(nn.Module):
    """`rows`: [vocab, row bytes] uint8 blocks, in the file's layout or (`packed`, a tied head's
    tensor, shared) in the kernels' row layout."""

    def __init__(self, rows: torch.Tensor | np.ndarray, qtype: str | int, shape: tuple[int, int], dtype: torch.dtype,
                 packed: bool = False):
        super().__init__()
        self.qtype = gguf.GGMLQuantizationType[qtype] if isinstance(qtype, str) else gguf.GGMLQuantizationType(qtype)
        self.hidden = shape[1]
        self.dtype = dtype
        self.packed = packed
        if isinstance(rows, np.ndarray):
            rows = torch.from_numpy(np.array(rows))
        self.register_buffer("rows", rows.reshape(shape[0], -1))  # [vocab, row bytes]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        picked = self.rows[ids]
        if self.packed:
            from ..kernels import unpack_rows
            picked = unpack_rows(picked, self.qtype)
        return dequantize(picked, self.qtype, (ids.numel(), self.hidden)).to(self.dtype)
