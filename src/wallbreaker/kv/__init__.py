"""The paged KV cache: block pool (physical), block manager (per-sequence tables), tensors."""
from .block_manager import BlockManager
from .block_pool import Block, BlockPool, hash_block
from .cache import KVCache

__all__ = ["Block", "BlockManager", "BlockPool", "KVCache", "hash_block"]
