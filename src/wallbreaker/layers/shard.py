"""Which rows or columns of each weight a rank holds.

Attention is split by whole heads, KV heads first: a rank holds a run of KV heads and exactly the
query heads that read them, so grouped-query attention stays uniform on every rank. With fewer KV
heads than ranks, each KV head is held by several ranks (replicated, as vLLM does) and its query
heads are divided among them. Splits need not be even (SmolLM2's 3 KV heads over 2 ranks: 2 + 1).
Experts are split as a dense MLP is, every rank holding its share of every expert's FFN columns
(the router is replicated; the experts' partial sums take one all-reduce for all of them).
Everything else is an even split, on 32-column boundaries where possible so that the 32-weight GGUF
blocks are never cut (a cut block is requantized to Q8_0 at load); the vocabulary is split in equal
chunks (the last may be short) so that every rank's logits pad to one width for the gather.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..config import ModelConfig
from ..errors import InvalidRequestError

ALIGN = 32  # the block of Q4_0/Q4_1/Q5_x/Q8_0: a boundary here keeps the stored blocks whole


@dataclass(frozen=True)
class HeadShard:
    q: range  # query heads this rank holds
    kv: range  # its KV heads

    def q_rows(self, head_dim: int) -> range:
        return range(self.q.start * head_dim, self.q.stop * head_dim)

    def kv_rows(self, head_dim: int) -> range:
        return range(self.kv.start * head_dim, self.kv.stop * head_dim)


@dataclass(frozen=True)
class Shard:
    """A rank's place in the tensor-parallel group; `group` carries the model's collectives."""

    rank: int
    world_size: int
    group: Any = None  # torch.distributed ProcessGroup; None: the default group

    def split(self, n: int) -> range:
        return even_range(n, self.world_size, self.rank, ALIGN)

    def vocab(self, n: int) -> range:
        chunk = vocab_chunk(n, self.world_size)
        return range(min(n, self.rank * chunk), min(n, (self.rank + 1) * chunk))

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        return head_shard(num_heads, num_kv_heads, self.rank, self.world_size)


def even_range(n: int, parts: int, index: int, align: int = 1) -> range:
    """The `index`-th of `parts` contiguous ranges covering 0..n, as equal as possible, with
    boundaries on multiples of `align` when n has enough of them."""
    if n % align or n // align < parts:
        align = 1
    units = n // align
    return range(align * (units * index // parts), align * (units * (index + 1) // parts))


def vocab_chunk(n: int, parts: int) -> int:
    return -(-n // parts)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= world_size:
        kv = even_range(num_kv_heads, world_size, rank)
        return HeadShard(range(kv.start * group, kv.stop * group), kv)
    kv_head = rank * num_kv_heads // world_size
    replicas = [r for r in range(world_size) if r * num_kv_heads // world_size == kv_head]
    if group < len(replicas):
        raise InvalidRequestError(
            f"tensor_parallel_size={world_size} cannot split {num_heads} attention heads "
            f"({num_kv_heads} KV heads): some rank would hold no query head")
    q = even_range(group, len(replicas), replicas.index(rank))
    first = kv_head * group
    return HeadShard(range(first + q.start, first + q.stop), range(kv_head, kv_head + 1))


def check_splittable(cfg: ModelConfig, world_size: int) -> None:
    """Raises a clear error, before any process starts, if `cfg` cannot run on `world_size` ranks."""
    for rank in range(world_size):
        head_shard(cfg.num_heads, cfg.num_kv_heads, rank, world_size)
        if cfg.ssm_num_heads and cfg.ssm_num_groups:  # Mamba2 layers: heads over groups as queries over KV heads
            head_shard(cfg.ssm_num_heads, cfg.ssm_num_groups, rank, world_size)
    if cfg.intermediate_size < world_size or cfg.vocab_size < world_size or cfg.expert_ffn < world_size:
        raise InvalidRequestError(f"tensor_parallel_size={world_size} exceeds the model's MLP or vocabulary size")


def local_kv_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config a rank's KV pool is sized by: its own heads only."""
    heads = shard.heads(cfg.num_heads, cfg.num_kv_heads)
    return replace(cfg, num_heads=len(heads.q), num_kv_heads=len(heads.kv))
