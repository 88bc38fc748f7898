"""The pieces of a tensor-parallel model that talk across ranks. Column-parallel layers need no
wrapper: a rank's slice of the output rows is an ordinary linear layer whose output stays local."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .shard import Shard


class RowParallelLinear(nn.Module):
    """A linear layer holding a slice of the input features: the ranks' partial products are summed
    by one all-reduce (after attention's output projection, after the MLP's down projection)."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, shard: Shard):
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", bias)
        self.group = shard.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class AllReduce(nn.Module):
    """The ranks' partial outputs summed (a mixture of experts' down projections, reduced once for
    all experts); without tensor parallelism, the identity."""

    def __init__(self, shard: Shard | None):
        super().__init__()
        self.group = None if shard is None else shard.group
        self.enabled = shard is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x


class VocabParallelEmbedding(nn.Module):
    """A slice of the embedding rows: each rank looks up the ids it holds, zeros for the others,
    and one all-reduce assembles the full embeddings."""

    def __init__(self, inner: nn.Module, rows: range, shard: Shard):
        super().__init__()
        self.inner = inner
        self.start, self.size = rows.start, len(rows)
        self.group = shard.group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.size)  # [T]
        x = self.inner(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)  # [T, hidden]
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelHead(nn.Module):
    """A slice of the output head: each rank computes its vocabulary chunk's logits and rank 0
    gathers them (the only rank that samples). Other ranks return their own chunk."""

    def __init__(self, inner: nn.Module, vocab_size: int, chunk: int, shard: Shard):
        super().__init__()
        self.inner = inner
        self.vocab_size, self.chunk = vocab_size, chunk
        self.rank, self.world_size, self.group = shard.rank, shard.world_size, shard.group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        y = self.inner(hidden)  # [rows, this rank's vocabulary]
        if y.shape[-1] < self.chunk:
            y = F.pad(y, (0, self.chunk - y.shape[-1]))
        y = y.contiguous()
        parts = [torch.empty_like(y) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(y, parts, dst=0, group=self.group)
        if parts is None:
            return y
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]  # [rows, vocab]
