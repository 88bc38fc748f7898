"""A quantized linear layer for encoders, whose every step is a whole batch of prompts: our kernels
for a few rows; for many rows, the same blocks dequantized once to bfloat16 and multiplied by
torch's bfloat16 matmul, which on a CPU with AMX or AVX-512 BF16 is the faster engine by far
(4096 x 384 x 1536 on the 2-thread Xeon: 17 ms for our Q8_0 kernel, 12 ms float32, 1.6 ms bfloat16
including the activations' conversion; benchmarks/embeddings.py). The weights are the quantized
ones either way (a Q8_0 value d * q rounded once more, to bfloat16's 8 bits, like the activations).
The bfloat16 copy costs twice the blocks' memory: kept for encoders alone, which are small."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import QuantLinear

MIN_ROWS = 64  # fewer rows than this stay on our kernels (measured: they win below a few dozen)


def bf16_matmul_is_fast() -> bool:
    """Whether oneDNN runs bfloat16 natively here (AVX-512 BF16 or AMX); elsewhere it emulates it."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class WideRowsLinear(nn.Module):
    def __init__(self, quant: QuantLinear):
        super().__init__()
        self.quant = quant
        self.weight = nn.Parameter(quant.dequantize().to(torch.bfloat16), requires_grad=False)  # [out, in]
        self.bias = quant._bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < MIN_ROWS:
            return self.quant(x)
        y = F.linear(x.to(torch.bfloat16), self.weight).float()
        return y if self.bias is None else y + self.bias


def for_wide_batches(linear: nn.Module) -> nn.Module:
    """`linear` as an encoder runs it best: a QuantLinear gets the bfloat16 path for wide batches
    where the CPU runs bfloat16 natively; anything else is returned as it is."""
    if isinstance(linear, QuantLinear) and bf16_matmul_is_fast():
        return WideRowsLinear(linear)
    return linear
