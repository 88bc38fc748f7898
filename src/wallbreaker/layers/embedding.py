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
    def __init__(self, raw: np.ndarray, qtype: str, shape: tuple[int, int], dtype: torch.dtype):
        super().__init__()
        self.qtype = gguf.GGMLQuantizationType[qtype]
        self.hidden = shape[1]
        self.dtype = dtype
        self.register_buffer("rows", torch.from_numpy(np.array(raw).reshape(shape[0], -1)))  # [vocab, row bytes]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.rows[ids], self.qtype, (ids.numel(), self.hidden)).to(self.dtype)
