"""What a loader hands the engine: the config, lazily loaded weights, the tokenizer and the chat template."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ModelConfig
from ..errors import ModelFormatError
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer


@dataclass
class WeightRef:
    """One stored tensor. `load()` gives it as float32 in canonical layout; nothing is read before that."""

    name: str
    shape: tuple[int, ...]
    stored_type: str  # "F32", "BF16", "Q4_1", ...
    nbytes: int  # bytes as stored
    load: Callable[[], torch.Tensor] = field(repr=False)
    raw: Any = field(default=None, repr=False)  # the stored bytes (GGUF), for kernels that read them
    quant: Any = field(default=None, repr=False)  # formats.quantized_hf.QuantInfo of a wallbreaker-quantized weight
    load_part: Callable[[int, int, int], torch.Tensor] | None = field(default=None, repr=False)  # (dim, lo, hi)
    # The stored GGUF blocks, for the kernels (wallbreaker.kernels): [rows, row bytes] uint8 in the
    # file's block layout and canonical row order; `blocks_part(dim, lo, hi)` those of a row or
    # column range (None where a column bound cuts a block). None: no blocks are stored.
    blocks: Callable[[], torch.Tensor] | None = field(default=None, repr=False)
    blocks_part: Callable[[int, int, int], torch.Tensor | None] | None = field(default=None, repr=False)
    blocks_mapped: bool = False  # `blocks()` and row ranges of `blocks_part` are views of the file's mapping
    # A 3-D expert tensor [experts, out, in]: each expert's [out, in] as a WeightRef of its own
    # (its stored blocks a view of the file where it has them), so that a model never loads the rest.
    experts: list["WeightRef"] | None = field(default=None, repr=False)

    def load_slice(self, dim: int, lo: int, hi: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) lo..hi of `load()`, reading only the stored bytes they need
        where the format allows (a tensor-parallel rank never holds the whole tensor)."""
        if (lo, hi) == (0, self.shape[dim]):
            return self.load()
        if self.load_part is not None:
            return self.load_part(dim, lo, hi)
        return self.load().narrow(dim, lo, hi - lo).clone()


def row_view(ref: WeightRef, name: str, lo: int, hi: int) -> WeightRef:
    """Rows lo..hi of `ref` as a tensor of its own: one projection of a fused one (Phi-3's q/k/v in
    `attn_qkv`, gate and up in `ffn_up`). Its float values, slices and stored blocks all come from
    those rows of `ref` alone."""
    shape = (hi - lo, *ref.shape[1:])
    nbytes = ref.nbytes * (hi - lo) // ref.shape[0]

    def load_part(dim: int, a: int, b: int) -> torch.Tensor:
        if dim == 0:
            return ref.load_slice(0, lo + a, lo + b)
        return ref.load_slice(1, a, b)[lo:hi].clone()

    blocks = blocks_part = None
    if ref.blocks_part is not None:
        def blocks() -> torch.Tensor | None:
            return ref.blocks_part(0, lo, hi)

        def blocks_part(dim: int, a: int, b: int) -> torch.Tensor | None:
            if dim == 0:
                return ref.blocks_part(0, lo + a, lo + b)
            cols = ref.blocks_part(1, a, b)
            return None if cols is None else cols[lo:hi].contiguous()
    return WeightRef(name, shape, ref.stored_type, nbytes, lambda: ref.load_slice(0, lo, hi), raw=None,
                     load_part=load_part, blocks=blocks, blocks_part=blocks_part, blocks_mapped=ref.blocks_mapped)


def stacked_experts(name: str, experts: list[WeightRef]) -> WeightRef:
    """One [experts, out, in] tensor of per-expert [out, in] ones (a Hugging Face folder stores each
    expert's projection on its own)."""
    first = experts[0]
    for e in experts:
        if tuple(e.shape) != tuple(first.shape):
            raise ModelFormatError(f"expert tensor {e.name!r} has shape {tuple(e.shape)}, its siblings "
                                   f"{tuple(first.shape)}")
    types = {e.stored_type for e in experts}
    return WeightRef(name, (len(experts), *first.shape), first.stored_type if len(types) == 1 else "mixed",
                     sum(e.nbytes for e in experts), lambda: torch.stack([e.load() for e in experts]),
                     experts=experts)


@dataclass
class ModelFiles:
    path: Path
    format: str  # "gguf" | "hf"
    config: ModelConfig
    weights: dict[str, WeightRef]
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())
