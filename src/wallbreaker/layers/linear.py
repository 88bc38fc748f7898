"""Linear layers: y = x Wᵀ + b. The float one is the exact reference; `QuantLinear` (the `auto`
path) keeps GGUF blocks as stored and runs our own kernels over them (wallbreaker.kernels). The
PyTorch int4/int8 ones remain as the measured baseline of benchmarks/kernels.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels as qk
from ..quant.int4 import Int4Groups


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In the weights' dtype (the residual stream between layers is float32 on every path)."""
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


class QuantLinear(nn.Module):
    """GGUF blocks in the kernels' row layout, one or more segments (fused projections of the same
    input, each with its own type and rows) computed in one call; float32 out."""

    def __init__(self, segments: list[tuple[torch.Tensor, int]], in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = in_features
        self.qtypes = [int(q) for _, q in segments]
        self.rows = [int(w.shape[0]) for w, _ in segments]
        self.out_features = sum(self.rows)
        for i, (w, _) in enumerate(segments):
            self.register_buffer(f"blocks{i}", w)
        self.blocks = [w for w, _ in segments]  # the call's list (the buffers above are the same tensors)
        self.register_buffer("bias", bias)

    @classmethod
    def from_blocks(cls, segments: list[tuple[torch.Tensor, int]], in_features: int,
                    bias: torch.Tensor | None = None) -> "QuantLinear":
        """Segments of blocks in the file's layout (`WeightRef.blocks`), packed once here."""
        return cls([(qk.pack_rows(w, q), q) for w, q in segments], in_features, bias)

    def as_embedding(self, dtype: torch.dtype) -> nn.Module:
        """The same blocks read by rows, for a tied embedding: one copy serves both ends."""
        from .embedding import QuantizedEmbedding
        assert len(self.blocks) == 1, "a tied embedding is one tensor"
        return QuantizedEmbedding(self.blocks[0], self.qtypes[0], (self.out_features, self.in_features), dtype,
                                  packed=True)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([qk.dequantize_packed(w, q, self.in_features) for w, q in zip(self.blocks, self.qtypes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():  # the dispatcher op, which torch.compile traces
            y = torch.ops.wallbreaker.qmatmul(flat, self.blocks, self.qtypes)
        else:  # the pybind11 function: less call overhead (docs/kernels.md)
            y = qk._C.qmatmul(flat, self.blocks, self.qtypes)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """Group-wise int4 weights, packed by `_convert_weight_to_int4pack_for_cpu`."""

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = groups.codes.shape[1]
        self.out_features = groups.codes.shape[0]
        self.group_size = groups.group_size
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.int(), 1))
        scales_zeros = torch.stack([groups.scale.t(), groups.zero.t()], dim=-1)  # [in / group, out, 2]
        self.register_buffer("scales_zeros", scales_zeros.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """bfloat16 out: what follows inside a layer stays in bfloat16 (the residual stream, float32,
        takes the sum). Saves two conversions per projection on the decode hot path."""
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_zeros)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """Per-output-channel symmetric int8 weights (for stored formats with more than 4 bits)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
        self.register_buffer("weight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def as_embedding(self, dtype: torch.dtype) -> nn.Module:
        """The same table read by rows, for a tied embedding: one copy serves both ends."""
        return RowLookup(self, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scale)
        y = y.view(*x.shape[:-1], self.out_features)  # bfloat16, as Int4Linear
        return y if self.bias is None else y + self.bias


class RowLookup(nn.Module):
    def __init__(self, table: "Int8Linear", dtype: torch.dtype):
        super().__init__()
        self.table = [table]  # a list, so the weights are not registered (and counted) twice
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table[0]
        return (t.weight[ids].to(self.dtype) * t.scale[ids, None].to(self.dtype))


def module_bytes(module: nn.Module) -> int:
    """Resident bytes of a module's weights (shared tensors counted once)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
