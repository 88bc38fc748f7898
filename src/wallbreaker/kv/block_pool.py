"""The physical side of the paged KV cache: a fixed set of blocks, reference counts, a free list,
and the prefix cache (full blocks keyed by a chained digest of their tokens).

Free blocks sit in one ordered dict: blocks without a hash at the front (nothing to lose), cached
blocks behind them in least-recently-freed order. Allocation takes from the front, so a cached block
is evicted only when no plain free block is left; a cache hit pulls its block out of the middle in O(1).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set when the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens behind `hash`, to verify a hit


def hash_block(parent_hash: bytes | None, token_ids: tuple[int, ...], prompt_tokens: int | None = None,
               extra: bytes = b"") -> bytes:
    """SHA-256 over the parent block's digest and this block's tokens: a block's key covers every
    token before it, so equal keys mean equal prefixes. A collision-resistant digest, not Python's
    `hash`, so that no prompt can be crafted to land on another request's blocks (the construction
    behind vLLM's CVE-2025-25183).

    `prompt_tokens`: how many of the block's tokens were prompt tokens, where fewer than all (a block
    holding generated tokens). In batch-invariant mode a prompt token's K/V come from the prefill path
    and a generated token's from the decode path (layers/linear.py), so a block of generated tokens
    must not serve a prompt made of the same tokens, nor the other way round.

    `extra`: what else the block's K/V depend on (the pixel digests of the images whose placeholder
    tokens it holds: kv/block_manager.py `_images_in`)."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    if prompt_tokens is not None and prompt_tokens < len(token_ids):
        digest.update(b"prompt tokens:%d" % prompt_tokens)
    if extra:
        digest.update(b"images:" + extra)
    return digest.digest()


def salt_digest(cache_salt: str | None, adapter: bytes | None = None) -> bytes | None:
    """The parent digest of a request's first block: requests share cached blocks only when their
    salts are equal (vLLM's per-request `cache_salt`, for tenants who must not share a cache) and
    they run with the same LoRA adapter (`adapter`: its key, lora/registry.py; None: the base model)."""
    if cache_salt is None and adapter is None:
        return None
    digest = hashlib.sha256(b"cache_salt:" + (cache_salt or "").encode())
    if adapter is not None:
        digest.update(b"|lora:" + adapter)
    return digest.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, Block] = {}
        self.prefix_queries = 0  # full prompt blocks looked up
        self.prefix_hits = 0  # of which found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> Block:
        if not self._free:
            raise RuntimeError("KV block pool exhausted")  # callers check num_free first
        block = self.blocks[self._free.popitem(last=False)[0]]
        if block.hash is not None:
            del self._cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def retain(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        assert block.ref_count > 0, f"block {block.block_id} released too often"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None
            if block.hash is None:
                self._free.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block of this key and these tokens, counted as a prefix-cache query."""
        self.prefix_queries += 1
        block = self.cached(block_hash, token_ids)
        if block is not None:
            self.prefix_hits += 1
        return block

    def cached(self, block_hash: bytes, token_ids: tuple[int, ...]) -> Block | None:
        block = self._cached.get(block_hash)
        return block if block is not None and block.token_ids == token_ids else None

    def register(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Offer a newly full block to the prefix cache (the first block with a given key wins).
        True if it is now the cached block of that key."""
        if not self.enable_prefix_caching or block.hash is not None or block_hash in self._cached:
            return False
        block.hash, block.token_ids = block_hash, token_ids
        self._cached[block_hash] = block
        return True
