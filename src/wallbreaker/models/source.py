"""How a model pulls its weights: as float tensors in the compute dtype (the exact path), or with
linear layers kept packed (the `auto` path): 4-bit stored formats as int4 groups, others as int8.

With tensor parallelism (`shard` set) each layer reads only this rank's rows or columns, and the
layers that must talk across ranks come wrapped (parallel/layers.py); without, the hints are ignored.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Literal

import torch
from torch import nn

from ..formats.weights import WeightRef
from ..layers.embedding import Embedding, QuantizedEmbedding
from ..layers.linear import Int4Linear, Int8Linear, Linear
from ..parallel.shard import HeadShard, Shard, vocab_chunk
from ..quant.int4 import Int4Groups


class WeightSource:
    def __init__(self, weights: dict[str, WeightRef], dtype: torch.dtype, packed: bool, shard: Shard | None = None):
        self.weights = weights
        self.dtype = dtype
        self.packed = packed
        self.shard = shard

    def tensor(self, name: str) -> torch.Tensor:
        return self.weights[name].load().to(self.dtype)

    def has(self, name: str) -> bool:
        return name in self.weights

    def attention_heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        """The query and KV heads this rank holds: all of them without tensor parallelism."""
        if self.shard is None:
            return HeadShard(range(num_heads), range(num_kv_heads))
        return self.shard.heads(num_heads, num_kv_heads)

    def linear(self, names: list[str], bias_names: list[str] | None = None,
               parallel: Literal["column", "row"] | None = None, slices: list[range] | None = None) -> nn.Module:
        """One module for the named projections of the same input, fused along the output dim.

        Under tensor parallelism, "column" keeps this rank's output rows and "row" its input columns
        (the ranks' partial products then summed); `slices[i]` is the range of names[i] it keeps,
        an even share by default."""
        refs = [self.weights[n] for n in names]
        if self.shard is None or parallel is None:
            bias = torch.cat([self.weights[n].load() for n in bias_names]) if bias_names else None
            return self._fused([r.load for r in refs], [r.int4 for r in refs], bias)
        dim = 0 if parallel == "column" else 1
        slices = slices or [self.shard.split(r.shape[dim]) for r in refs]
        loads = [partial(r.load_slice, dim, s.start, s.stop) for r, s in zip(refs, slices)]
        int4s = [partial(r.int4_slice, dim, s.start, s.stop) if r.int4 is not None else None
                 for r, s in zip(refs, slices)]
        if parallel == "column":
            bias = torch.cat([self.weights[n].load_slice(0, s.start, s.stop) for n, s in zip(bias_names, slices)]) \
                if bias_names else None
            return self._fused(loads, int4s, bias)
        from ..parallel.layers import RowParallelLinear
        bias = torch.cat([self.weights[n].load() for n in bias_names]).to(self.dtype) if bias_names else None
        return RowParallelLinear(self._fused(loads, int4s, None), bias, self.shard)

    def _fused(self, loads: list[Callable[[], torch.Tensor]], int4s: list[Callable | None],
               bias: torch.Tensor | None) -> nn.Module:
        bias = None if bias is None else bias.to(self.dtype)
        if not self.packed:
            return Linear(torch.cat([load().to(self.dtype) for load in loads]), bias)
        groups = [f() for f in int4s] if all(f is not None for f in int4s) else []
        if groups and all(g is not None for g in groups):
            return Int4Linear(Int4Groups.cat(groups), bias)
        return Int8Linear(torch.cat([load() for load in loads]), bias)

    def embedding_and_head(self, tie_word_embeddings: bool) -> tuple[nn.Module, nn.Module]:
        """The token embedding and the output head; a tied pair shares one copy of the table."""
        if self.shard is not None:
            return self._vocab_parallel(tie_word_embeddings)
        name = "token_embd.weight"
        ref = self.weights[name]
        if not self.packed:
            embedding = Embedding(self.tensor(name))
            head = Linear(embedding.weight) if tie_word_embeddings else self.linear(["output.weight"])
        elif tie_word_embeddings:
            head = self.linear([name])
            # an int8 head is also read by rows; an int4 one is not, so rows come from the stored blocks
            embedding = head.as_embedding(self.dtype) if isinstance(head, Int8Linear) \
                else self._embedding(ref, range(ref.shape[0]))
        else:
            embedding = self._embedding(ref, range(ref.shape[0]))
            head = self.linear(["output.weight"])
        return embedding, head

    def _embedding(self, ref: WeightRef, rows: range) -> nn.Module:
        """Untied packed path: GGUF blocks stay stored, only looked-up rows are dequantized."""
        if self.packed and ref.raw is not None and ref.stored_type not in ("F32", "F16", "BF16"):
            raw = ref.raw.reshape(ref.shape[0], -1)[rows.start:rows.stop]
            return QuantizedEmbedding(raw, ref.stored_type, (len(rows), ref.shape[1]), self.dtype)
        return Embedding(ref.load_slice(0, rows.start, rows.stop).to(self.dtype))

    def _vocab_parallel(self, tie_word_embeddings: bool) -> tuple[nn.Module, nn.Module]:
        from ..parallel.layers import VocabParallelEmbedding, VocabParallelHead
        name = "token_embd.weight"
        ref = self.weights[name]
        vocab = self.shard.vocab(ref.shape[0])
        head = self.linear([name if tie_word_embeddings else "output.weight"], parallel="column", slices=[vocab])
        if not tie_word_embeddings:
            embedding = self._embedding(ref, vocab)
        elif self.packed:
            embedding = head.as_embedding(self.dtype)
        else:
            embedding = Embedding(head.weight)
        chunk = vocab_chunk(ref.shape[0], self.shard.world_size)
        return VocabParallelEmbedding(embedding, vocab, self.shard), VocabParallelHead(head, ref.shape[0], chunk, self.shard)
