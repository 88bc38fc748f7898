"""The KV tensors: every layer's K and V blocks in one preallocated pool tensor,
[layers, K/V, blocks, block_size, kv_heads, head_dim]. Zero-filled: attention masks the unused
slots of a gathered block, and a masked zero contributes nothing where garbage could be NaN."""
from __future__ import annotations

import numpy as np
import psutil
import torch

from ..config import ModelConfig


_SAME_SIZE_NUMPY = {4: np.int32, 2: np.int16}


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        if torch.device(device).type == "cpu" and dtype.itemsize in _SAME_SIZE_NUMPY:
            # calloc'd by numpy: the OS hands out zero pages as blocks are first written, so a large
            # pool costs no time at start and resident memory grows with use. (All-zero bits are 0.0.)
            self.tensor = torch.from_numpy(np.zeros(shape, dtype=_SAME_SIZE_NUMPY[dtype.itemsize])).view(dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensor[i, 0], self.tensor[i, 1]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.tensor.device)
            dst = torch.tensor([d for _, d in copies], device=self.tensor.device)
            self.tensor[:, :, dst] = self.tensor[:, :, src]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


def default_num_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype, memory_gb: float | None,
                       max_tokens: int) -> int:
    """Blocks for `memory_gb`, or else a quarter of the free memory, never more than `max_tokens` need."""
    per_block = bytes_per_block(config, block_size, dtype)
    budget = memory_gb * 2**30 if memory_gb is not None else psutil.virtual_memory().available / 4
    by_memory = int(budget // per_block)
    if memory_gb is None:
        by_memory = min(by_memory, -(-max_tokens // block_size))
    return max(by_memory, 1)
