"""Row and column ranges of a memory-mapped GGUF tensor, decoded without reading the rest.

Rows are contiguous in the file, so a row range is one span of the map. A column range reads, from
every row, just the stored blocks that cover it: when its ends fall on block boundaries the blocks
are exactly the slice; otherwise the covering blocks are decoded and trimmed (at most two blocks
a row of waste). llama q/k rows are un-permuted per head, so a row range must hold whole heads.

The stored blocks themselves (for the quantized kernels) come from `block_loaders`: the rows as a
view of the map where no row permutation applies (llama q/k rows are copies), column ranges (always
copies) only where both ends fall on block boundaries.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .dequant import block_info, dequantize
from .gguf_file import GGUFTensor
from .mapping import as_tensor
from .names import llama_unpermute

PartLoader = Callable[[int, int, int], torch.Tensor]


def part_loader(t: GGUFTensor, heads: int | None) -> PartLoader | None:
    """`WeightRef.load_part`: (dim, lo, hi) -> the float32 canonical slice."""
    block, size = block_info(t.ggml_type)
    if len(t.shape) > 2 or (len(t.shape) == 1 and block > 1):
        return None
    rows_n = t.shape[0]
    grid = t.raw.reshape(rows_n, -1)  # [rows, stored bytes per row]

    def unpermute(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if heads is None:
            return x
        head_dim = rows_n // heads
        assert lo % head_dim == 0 and hi % head_dim == 0, f"{t.name}: rows {lo}..{hi} cut a head"
        return llama_unpermute(x, (hi - lo) // head_dim)

    def covering(lo: int, hi: int) -> tuple[np.ndarray, int, int]:
        """The stored blocks that cover columns lo..hi of every row, their first column and width."""
        first, last = lo // block, -(-hi // block)
        return grid[:, first * size:last * size], first * block, (last - first) * block

    def load_part(dim: int, lo: int, hi: int) -> torch.Tensor:
        if dim == 0:
            return unpermute(dequantize(grid[lo:hi], t.ggml_type, (hi - lo, *t.shape[1:])), lo, hi)
        part, start, width = covering(lo, hi)
        x = dequantize(part, t.ggml_type, (rows_n, width))
        if (start, width) != (lo, hi - lo):
            x = x[:, lo - start:hi - start].clone()
        return unpermute(x, 0, rows_n)

    return load_part


def block_loaders(t: GGUFTensor, heads: int | None) -> tuple[Callable | None, Callable | None]:
    """(blocks, blocks_part) for `WeightRef`: [rows, row bytes] uint8 blocks in canonical row order
    (llama q/k rows un-permuted per head, by moving whole rows), and those of (dim, lo, hi)."""
    block, size = block_info(t.ggml_type)
    if len(t.shape) != 2 or block == 1:
        return None, None
    rows_n = t.shape[0]
    grid = t.raw.reshape(rows_n, -1)

    def order(lo: int, hi: int) -> torch.Tensor | None:
        if heads is None:
            return None
        head_dim = rows_n // heads
        assert lo % head_dim == 0 and hi % head_dim == 0, f"{t.name}: rows {lo}..{hi} cut a head"
        return llama_unpermute(torch.arange(hi - lo)[:, None], (hi - lo) // head_dim).flatten()

    def rows(lo: int, hi: int) -> torch.Tensor:
        perm = order(lo, hi)
        part = as_tensor(grid[lo:hi])
        return part if perm is None else part[perm].contiguous()

    def blocks() -> torch.Tensor:
        return rows(0, rows_n)

    def blocks_part(dim: int, lo: int, hi: int) -> torch.Tensor | None:
        if dim == 0:
            return rows(lo, hi)
        if lo % block or hi % block:
            return None
        part = torch.from_numpy(np.ascontiguousarray(grid[:, lo // block * size:hi // block * size]))
        perm = order(0, rows_n)
        return part if perm is None else part[perm].contiguous()

    return blocks, blocks_part
