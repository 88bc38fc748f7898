"""How a model pulls its weights: as float tensors in the compute dtype (the exact path), or with
linear layers kept packed (the `auto` path): 4-bit stored formats as int4 groups, others as int8."""
from __future__ import annotations

import torch
from torch import nn

from ..formats.weights import WeightRef
from ..layers.embedding import Embedding, QuantizedEmbedding
from ..layers.linear import Int4Linear, Int8Linear, Linear
from ..quant.int4 import Int4Groups


class WeightSource:
    def __init__(self, weights: dict[str, WeightRef], dtype: torch.dtype, packed: bool):
        self.weights = weights
        self.dtype = dtype
        self.packed = packed

    def tensor(self, name: str) -> torch.Tensor:
        return self.weights[name].load().to(self.dtype)

    def has(self, name: str) -> bool:
        return name in self.weights

    def linear(self, names: list[str], bias_names: list[str] | None = None) -> nn.Module:
        """One module for the named projections of the same input, fused along the output dim."""
        refs = [self.weights[n] for n in names]
        bias = torch.cat([self.weights[n].load() for n in bias_names]).to(self.dtype) if bias_names else None
        if not self.packed:
            return Linear(torch.cat([r.load().to(self.dtype) for r in refs]), bias)
        if all(r.int4 is not None for r in refs):
            return Int4Linear(Int4Groups.cat([r.int4() for r in refs]), bias)
        return Int8Linear(torch.cat([r.load() for r in refs]), bias)

    def embedding_and_head(self, tie_word_embeddings: bool) -> tuple[nn.Module, nn.Module]:
        """The token embedding and the output head; a tied pair shares one copy of the table."""
        name = "token_embd.weight"
        ref = self.weights[name]
        if not self.packed:
            embedding = Embedding(self.tensor(name))
            head = Linear(embedding.weight) if tie_word_embeddings else self.linear(["output.weight"])
        elif tie_word_embeddings:
            head = self.linear([name])
            embedding = head.as_embedding(self.dtype)
        else:
            stored = ref.raw is not None and ref.stored_type not in ("F32", "F16", "BF16")
            embedding = QuantizedEmbedding(ref.raw, ref.stored_type, ref.shape, self.dtype) if stored \
                else Embedding(self.tensor(name))
            head = self.linear(["output.weight"])
        return embedding, head
