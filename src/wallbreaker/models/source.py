"""How a model pulls its weights: as float tensors in the compute dtype (the exact path), or with
linear layers kept as GGUF blocks and run by our kernels (the `auto` path, wallbreaker.kernels):
weights stored in a covered block format keep their stored blocks; others get blocks at load
(kernels/blocks.py: Q4_1 for <= 4-bit int-code grids, Q5_0 for MXFP4's values, else Q8_0).

With tensor parallelism (`shard` set) each layer reads only this rank's rows or columns, and the
layers that must talk across ranks come wrapped (layers/parallel.py); without, the hints are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Literal

import gguf
import numpy as np
import torch
from torch import nn

from .. import kernels as qk
from ..formats.mapping import release_pages
from ..formats.weights import WeightRef
from ..kernels import SUPPORTED_TYPES
from ..kernels.blocks import q4_1_blocks, q5_0_exact_blocks, q8_0_blocks
from ..kernels.repack_cache import RepackCache
from ..layers.embedding import Embedding, QuantizedEmbedding
from ..layers.linear import Linear, QuantLinear
from ..layers.shard import HeadShard, Shard, vocab_chunk

T = gguf.GGMLQuantizationType



@dataclass
class Segment:
    """One projection (or its slice) of a linear layer, and where its kernel blocks can come from."""

    key: str  # the weight's name and slice, its name in the repack cache
    load: Callable[[], torch.Tensor]  # float values
    blocks: Callable[[], torch.Tensor | None] | None  # the stored blocks, in file layout
    grid: Callable | None  # an int-code grid (wallbreaker-quantized folders)
    qtype: T | None  # the stored blocks' type, where the kernels run it
    mapped: bool  # `blocks()` is a view of the file's mapping already in the kernels' layout
    raw: np.ndarray | None  # the stored bytes, whose mapped pages are given back once packed elsewhere
    fp4: bool = False  # stored as MXFP4, whose values Q5_0 holds exactly (kernels/blocks.py)


def _stored_type(ref: WeightRef) -> T | None:
    try:
        qtype = T[ref.stored_type]
    except KeyError:
        return None
    return qtype if qtype in SUPPORTED_TYPES and ref.blocks is not None else None


class WeightSource:
    def __init__(self, weights: dict[str, WeightRef], dtype: torch.dtype, packed: bool, shard: Shard | None = None,
                 repack: RepackCache | None = None):
        """`repack`: where blocks the kernels cannot read from the file's mapping are written once and
        mapped from (kernels/repack_cache.py); None keeps them in memory."""
        self.weights = weights
        self.dtype = dtype
        self.packed = packed
        self.shard = shard
        self.repack = repack

    def tensor(self, name: str) -> torch.Tensor:
        return self.weights[name].load().to(self.dtype)

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
        module = self.linear_of([self.weights[n] for n in names], [self.weights[n] for n in bias_names or []],
                                parallel, slices)
        if self.shard is None:
            # its segments (weight name, rows), which adapters target (lora/registry.py)
            module.lora_segments = tuple((n, self.weights[n].shape[0]) for n in names)
        return module

    def linear_of(self, refs: list[WeightRef], bias_refs: list[WeightRef] | None = None,
                  parallel: Literal["column", "row"] | None = None, slices: list[range] | None = None,
                  reduce: bool = True) -> nn.Module:
        """`linear` of the tensors themselves (an expert's, which have no name of their own).
        `reduce=False`: a row-parallel layer's partial product is left for the caller to sum."""
        if self.shard is None or parallel is None:
            bias = torch.cat([r.load() for r in bias_refs]) if bias_refs else None
            return self._fused([self._segment(r) for r in refs], refs[0].shape[1], bias)
        dim = 0 if parallel == "column" else 1
        slices = slices or [self.shard.split(r.shape[dim]) for r in refs]
        segments = [self._segment(r, dim, s.start, s.stop) for r, s in zip(refs, slices)]
        if parallel == "column":
            bias = torch.cat([r.load_slice(0, s.start, s.stop) for r, s in zip(bias_refs, slices)]) \
                if bias_refs else None
            return self._fused(segments, refs[0].shape[1], bias)
        inner = self._fused(segments, len(slices[0]), None)
        if not reduce:
            return inner
        from ..layers.parallel import RowParallelLinear
        bias = torch.cat([r.load() for r in bias_refs]).to(self.dtype) if bias_refs else None
        return RowParallelLinear(inner, bias, self.shard)

    def experts(self, prefix: str) -> tuple[list[nn.Module], list[nn.Module]]:
        """Each expert's fused gate|up and its down projection, from `<prefix>ffn_{gate,up,down}_exps.weight`
        ([experts, out, in]). Packed, each is a QuantLinear over its expert's rows of the stored
        tensor. Under tensor parallelism every rank holds every expert's share of the FFN columns
        (split as a dense MLP is); the down projections' partial sums are left to the caller, which
        reduces them once for all experts."""
        gate, up, down = (self.weights[f"{prefix}ffn_{x}_exps.weight"] for x in ("gate", "up", "down"))
        gate_up, downs = [], []
        for g, u, d in zip(gate.experts, up.experts, down.experts):
            gate_up.append(self.linear_of([g, u], parallel="column"))
            downs.append(self.linear_of([d], parallel="row", reduce=False))
        return gate_up, downs

    def router(self, name: str) -> Linear:
        """A mixture's router, float32 on every path (which experts run must not depend on rounding)."""
        return Linear(self.weights[name].load().float())

    def all_reduce(self) -> nn.Module:
        """The sum across ranks of a tensor-parallel layer's partial outputs (identity without)."""
        from ..layers.parallel import AllReduce
        return AllReduce(self.shard)

    def _segment(self, ref: WeightRef, dim: int | None = None, lo: int = 0, hi: int = 0) -> Segment:
        whole = dim is None or (lo, hi) == (0, ref.shape[dim])
        load = ref.load if whole else partial(ref.load_slice, dim, lo, hi)
        qtype = _stored_type(ref)
        blocks = None
        if qtype is not None:
            blocks = ref.blocks if whole or ref.blocks_part is None else partial(ref.blocks_part, dim, lo, hi)
        grid = None
        if ref.quant is not None and whole:
            grid = ref.quant.load
        elif ref.quant is not None and dim == 0:
            grid = lambda: ref.quant.load().rows(lo, hi)  # noqa: E731
        mapped = blocks is not None and ref.blocks_mapped and qk.layout_is_stored(qtype) and (whole or dim == 0)
        key = ref.name if whole else f"{ref.name}[{dim}:{lo}:{hi}]"
        raw = ref.raw if isinstance(ref.raw, np.ndarray) else None
        return Segment(key, load, blocks, grid, qtype, mapped, raw, ref.stored_type == "MXFP4")

    def _fused(self, segments: list[Segment], in_features: int, bias: torch.Tensor | None) -> nn.Module:
        bias = None if bias is None else bias.to(self.dtype)
        if not self.packed:
            return Linear(torch.cat([seg.load().to(self.dtype) for seg in segments]), bias)
        if in_features % 32:
            return Linear(torch.cat([seg.load().to(torch.float32) for seg in segments]), bias)
        return QuantLinear([self._kernel_blocks(seg) for seg in segments], in_features, bias)

    def _kernel_blocks(self, seg: Segment) -> tuple[torch.Tensor, T]:
        """The segment's blocks in the kernels' layout: the file's mapping itself where it is already
        that; else packed once into the repack cache and mapped from there."""
        if seg.mapped:
            return seg.blocks(), seg.qtype
        make = partial(self._packed_blocks, seg)
        return make() if self.repack is None else self.repack.packed(seg.key, make)

    @staticmethod
    def _packed_blocks(seg: Segment) -> tuple[torch.Tensor, T]:
        """The stored blocks; else Q4_1 of a <= 4-bit grid; else Q5_0 of MXFP4's values (the same
        values); else Q8_0 of the float values; packed.
        The file's pages read for it are given back: the packed copy is what the model reads."""
        stored = seg.blocks() if seg.blocks is not None else None
        if stored is not None:
            packed = qk.pack_rows(stored, seg.qtype)
            if seg.raw is not None:
                release_pages(seg.raw)
            return packed, seg.qtype
        if seg.grid is not None:
            q4 = q4_1_blocks(seg.grid())
            if q4 is not None:
                return qk.pack_rows(q4, T.Q4_1), T.Q4_1
        values = seg.load()
        q5 = q5_0_exact_blocks(values) if seg.fp4 else None
        if q5 is not None:
            return qk.pack_rows(q5, T.Q5_0), T.Q5_0
        return qk.pack_rows(q8_0_blocks(values), T.Q8_0), T.Q8_0

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
            embedding = self._tied_embedding(head, ref, range(ref.shape[0]))
        else:
            embedding = self._embedding(ref, range(ref.shape[0]))
            head = self.linear(["output.weight"])
        return embedding, head

    def embedding(self, name: str) -> nn.Module:
        """A token table of its own (no head shares it): stored blocks stay stored on the packed path."""
        ref = self.weights[name]
        return self._embedding(ref, range(ref.shape[0]))

    def _tied_embedding(self, head: nn.Module, ref: WeightRef, rows: range) -> nn.Module:
        """A quantized head's blocks also serve the lookups (one copy); a float head's table likewise."""
        if isinstance(head, QuantLinear):
            return head.as_embedding(self.dtype)
        return Embedding(head.weight if head.weight.dtype == self.dtype else ref.load_slice(0, rows.start, rows.stop)
                         .to(self.dtype))

    def _embedding(self, ref: WeightRef, rows: range) -> nn.Module:
        """Untied packed path: GGUF blocks stay stored, only looked-up rows are dequantized."""
        if self.packed and _stored_type(ref) is not None:
            part = ref.blocks_part(0, rows.start, rows.stop) if ref.blocks_part is not None else ref.blocks()
            return QuantizedEmbedding(part, ref.stored_type, (len(rows), ref.shape[1]), self.dtype)
        if self.packed and ref.raw is not None and ref.stored_type not in ("F32", "F16", "BF16"):
            raw = ref.raw.reshape(ref.shape[0], -1)[rows.start:rows.stop]
            return QuantizedEmbedding(raw, ref.stored_type, (len(rows), ref.shape[1]), self.dtype)
        return Embedding(ref.load_slice(0, rows.start, rows.stop).to(self.dtype))

    def _vocab_parallel(self, tie_word_embeddings: bool) -> tuple[nn.Module, nn.Module]:
        from ..layers.parallel import VocabParallelEmbedding, VocabParallelHead
        name = "token_embd.weight"
        ref = self.weights[name]
        vocab = self.shard.vocab(ref.shape[0])
        head = self.linear([name if tie_word_embeddings else "output.weight"], parallel="column", slices=[vocab])
        if not tie_word_embeddings:
            embedding = self._embedding(ref, vocab)
        elif self.packed:
            embedding = self._tied_embedding(head, ref, vocab)
        else:
            embedding = Embedding(head.weight)
        chunk = vocab_chunk(ref.shape[0], self.shard.world_size)
        return VocabParallelEmbedding(embedding, vocab, self.shard), VocabParallelHead(head, ref.shape[0], chunk, self.shard)
