"""The KV tensors: every layer's K and V blocks in one preallocated pool tensor,
[layers, K/V, kv_heads, blocks * block_size, head_dim]: a block is `block_size` consecutive slots.
Heads outermost, so gathering a sequence's slots yields [kv_heads, tokens, head_dim], the layout
attention multiplies with, without a transposing copy.

Quantized pages (int8, fp8) carry one float32 scale per token and head beside them,
[layers, K/V, kv_heads, slots]: written with the page by the fused cache write, read with it by
the paged attention kernel, copied with it on copy-on-write. A model whose K and V have a part no
token changes (a projection bias) sets it as the pages' offsets, [layers, K/V, kv_heads, head_dim]:
a page then rounds only the rest, and stands for page * scale + offset.

Zero-filled (attention masks the unused slots of a gathered block; a masked zero contributes
nothing where garbage could be NaN) and touched up front: a first write to a fresh page costs a
page fault, which the first decode steps would otherwise pay."""
from __future__ import annotations

import logging
import math
import mmap

import psutil
import torch

from ..config import EngineConfig, ModelConfig
from ..layers.attention import LayerKV
from ..layers.shard import Shard, local_kv_config

logger = logging.getLogger("wallbreaker.kv")

QUANTIZED_KV_DTYPES = frozenset({torch.int8, torch.float8_e4m3fn})


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros that cost memory only where written: on the CPU, fresh anonymous pages (the kernel maps
    its zero page until a write), not `torch.zeros`, which touches every byte at start: a 4 GB pool
    took 2.4 s to load and 4 GB of RSS before its first token."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0:  # nothing to map: a model without attention layers
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # the tensor keeps `pages` alive


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (config.num_attention_layers, 2, config.num_kv_heads, num_blocks * block_size, config.head_dim)
        self.tensor = lazy_zeros(shape, dtype, device)
        self.scales = lazy_zeros(shape[:-1], torch.float32, device) if dtype in QUANTIZED_KV_DTYPES else None
        self.offsets: torch.Tensor | None = None
        self.block_size = block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def set_offsets(self, per_layer: list[torch.Tensor | None]) -> None:
        """Each layer's [K/V, kv_heads, head_dim] offsets (None: zero); only quantized pages use them,
        and only before the first write."""
        if self.scales is None or all(o is None for o in per_layer):
            self.offsets = None
            return
        shape = self.tensor.shape
        self.offsets = torch.zeros(shape[0], 2, shape[2], shape[4], dtype=torch.float32, device=self.tensor.device)
        for i, o in enumerate(per_layer):
            if o is not None:
                self.offsets[i] = o

    def layer(self, i: int) -> LayerKV:
        """Layer i's pages (views of the pool), with their scales (and offsets) for int8 / fp8 pages."""
        if self.scales is None:
            return LayerKV(self.tensor[i, 0], self.tensor[i, 1])
        offsets = (None, None) if self.offsets is None else (self.offsets[i, 0], self.offsets[i, 1])
        return LayerKV(self.tensor[i, 0], self.tensor[i, 1], self.scales[i, 0], self.scales[i, 1], *offsets)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            offsets = torch.arange(self.block_size, device=self.tensor.device)
            src = (torch.tensor([s for s, _ in copies], device=self.tensor.device)[:, None] * self.block_size + offsets)
            dst = (torch.tensor([d for _, d in copies], device=self.tensor.device)[:, None] * self.block_size + offsets)
            self.tensor[:, :, :, dst.flatten()] = self.tensor[:, :, :, src.flatten()]
            if self.scales is not None:
                self.scales[:, :, :, dst.flatten()] = self.scales[:, :, :, src.flatten()]

    # -- one block's pages, for the disk tier and saved sessions (kv/disk_cache.py, kv/sessions.py) --
    def read_block(self, block_id: int) -> list[torch.Tensor]:
        """Copies of block `block_id`'s pages, [layers, K/V, kv_heads, block_size, head_dim], and of
        their scales (int8 / fp8 pages), [layers, K/V, kv_heads, block_size]: in the pool's dtype."""
        slots = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        parts = [self.tensor[:, :, :, slots].clone()]
        if self.scales is not None:
            parts.append(self.scales[:, :, :, slots].clone())
        return parts

    def write_block(self, block_id: int, parts: list[torch.Tensor]) -> None:
        """Block `block_id`'s pages (and scales) set from `read_block`'s shapes and dtypes."""
        slots = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        self.tensor[:, :, :, slots] = parts[0]
        if self.scales is not None:
            self.scales[:, :, :, slots] = parts[1]

    @property
    def block_shapes(self) -> list[tuple[int, ...]]:
        layers, kv, heads, _, head_dim = self.tensor.shape
        shapes = [(layers, kv, heads, self.block_size, head_dim)]
        return shapes + [(layers, kv, heads, self.block_size)] if self.scales is not None else shapes

    @property
    def block_dtypes(self) -> list[torch.dtype]:
        return [self.tensor.dtype] + ([torch.float32] if self.scales is not None else [])

    @property
    def block_nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.block_shapes, self.block_dtypes))

    @property
    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.scales, self.offsets) if t is not None)
        return self.tensor.numel() * self.tensor.element_size() + extra


DEFAULT_MAX_GB = 4.0  # pages are zeroed on first touch, so an unused pool costs nothing, but a host shares its memory
HEADROOM_GB = 1.0  # kept free beside the weights and the pool: activations, the interpreter, the OS
MAX_FREE_BLOCKS = 2**16  # block ids of a model without attention layers: 1M tokens at 16 a block


def scale_bytes(dtype: torch.dtype) -> int:
    """Bytes of scale stored beside one head's K (or V) at one position: none in a float cache, one
    float32 for int8 and fp8 pages."""
    return 4 if dtype in QUANTIZED_KV_DTYPES else 0


def kv_bytes_per_position(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token position in one layer, as a cache of `dtype` stores them: the one KV-bytes
    formula, which the pool's size, the roofline's reads and `inspect` all count from."""
    return 2 * config.num_kv_heads * (config.head_dim * dtype.itemsize + scale_bytes(dtype))


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all attention layers (each stores every position, sliding or not)."""
    return config.num_attention_layers * kv_bytes_per_position(config, dtype)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return block_size * kv_bytes_per_token(config, dtype)


def memory_budget(memory_gb: float | None, weight_bytes: int = 0) -> float:
    """Bytes for the KV pool (and a recurrent model's state pool): `memory_gb`, or by default half of
    what the free memory leaves after the weights (`weight_bytes`, which a step reads from the page
    cache, so they must stay there) and HEADROOM_GB, at most DEFAULT_MAX_GB."""
    if memory_gb is not None:
        return memory_gb * 2**30
    free = psutil.virtual_memory().available
    return min(max(free - weight_bytes - HEADROOM_GB * 2**30, 0) / 2, DEFAULT_MAX_GB * 2**30)


def default_num_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype, memory_gb: float | None,
                       max_tokens: int, weight_bytes: int = 0, reserved_bytes: int = 0) -> int:
    """Blocks for the `memory_budget`, less `reserved_bytes` (a state pool's), never more than
    `max_tokens` need when the budget is the default one. A model without attention layers gets
    blocks that cost nothing (their ids still key the prefix cache). Logged at INFO."""
    per_block = bytes_per_block(config, block_size, dtype)
    if per_block == 0:  # ids only; a pure Mamba2 GGUF states a context of 2**20 tokens, for 64 sequences
        return max(min(-(-max_tokens // block_size), MAX_FREE_BLOCKS), 1)
    budget = memory_budget(memory_gb, weight_bytes) - reserved_bytes
    if memory_gb is not None:
        return max(int(budget // per_block), 1)
    blocks = max(min(int(budget // per_block), -(-max_tokens // block_size)), 1)
    logger.info("KV cache: %d blocks of %d tokens (%.2f GB), from %.1f GB free and %.2f GB of weights "
                "(kv_cache_memory_gb sets it)", blocks, block_size, blocks * per_block / 1e9,
                psutil.virtual_memory().available / 1e9, weight_bytes / 1e9)
    return blocks


def make_kv_cache(model_config: ModelConfig, config: EngineConfig, num_blocks: int, device: torch.device,
                  shard: Shard | None = None) -> KVCache:
    """The KV pool; a tensor-parallel rank's holds the same blocks, for its own KV heads only."""
    if shard is not None:
        model_config = local_kv_config(model_config, shard)
    return KVCache(model_config, num_blocks, config.kv_block_size, config.kv_cache_torch_dtype, device)
