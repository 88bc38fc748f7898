"""Block pool and block tables: allocation, freeing, forking, copy-on-write, prefix hits, eviction."""
from dataclasses import dataclass, field

import pytest

from wallbreaker.kv import BlockManager, BlockPool, hash_block
from wallbreaker.kv import block_pool

BS = 4


@dataclass
class Seq:
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None


def manager(num_blocks=8, caching=True) -> BlockManager:
    return BlockManager(BlockPool(num_blocks, caching), BS)


def run_prompt(bm: BlockManager, seq: Seq) -> int:
    n = bm.allocate_prompt(seq, 10_000)
    bm.commit(seq, n)
    return n


def test_allocate_takes_blocks_only_as_needed_and_free_returns_them():
    bm = manager()
    seq = Seq(list(range(6)))
    assert run_prompt(bm, seq) == 6
    assert len(seq.block_table) == 2 and bm.pool.num_used == 2
    seq.token_ids.append(99)
    assert bm.can_append(seq, 1)
    assert bm.append_slots(seq, 1) == []
    bm.commit(seq, 1)
    assert len(seq.block_table) == 2  # 7 tokens still fit in two blocks
    seq.token_ids.append(100)
    bm.append_slots(seq, 1)
    bm.commit(seq, 1)
    seq.token_ids.append(101)
    bm.append_slots(seq, 1)
    assert len(seq.block_table) == 3  # the ninth token opens a third block
    bm.free(seq)
    assert bm.pool.num_used == 0 and seq.block_table == []


def test_pool_refuses_when_exhausted_and_can_append_says_so():
    bm = manager(num_blocks=2)
    a = Seq(list(range(8)))
    run_prompt(bm, a)
    b = Seq(list(range(100, 103)))
    assert bm.allocate_prompt(b, 100) == 0 and b.block_table == []
    a.token_ids.append(1)
    assert not bm.can_append(a, 1)


def test_prefix_hit_reuses_full_blocks_and_recomputes_the_last_token():
    bm = manager()
    a = Seq(list(range(12)))  # three full blocks
    run_prompt(bm, a)
    b = Seq(list(range(12)))
    n = bm.allocate_prompt(b, 100)
    # only two blocks may be reused: the last prompt token must be computed for its logits
    assert b.num_computed_tokens == 8 and n == 4
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.pool.blocks[a.block_table[0]].ref_count == 2
    assert bm.pool.prefix_hits == 2


def test_prefix_miss_when_tokens_differ_and_chained_hash_covers_earlier_blocks():
    bm = manager()
    a = Seq(list(range(9)))
    run_prompt(bm, a)
    b = Seq([99] + list(range(1, 9)))  # first block differs, second block's tokens equal
    assert bm.allocate_prompt(b, 100) == 9 and b.num_computed_tokens == 0
    assert hash_block(None, (0, 1, 2, 3)) != hash_block(None, (99, 1, 2, 3))


def test_freed_cached_blocks_are_revived_then_evicted_lru_when_needed():
    bm = manager(num_blocks=4)
    a = Seq(list(range(9)))
    run_prompt(bm, a)
    bm.free(a)
    assert bm.pool.num_free == 4
    b = Seq(list(range(9)))
    bm.allocate_prompt(b, 100)
    assert b.num_computed_tokens == 8  # both full blocks came back from the free list
    bm.free(b)
    c = Seq(list(range(500, 516)))  # needs all four blocks: the cached ones get evicted
    assert run_prompt(bm, c) == 16
    d = Seq(list(range(9)))
    bm.free(c)
    bm.allocate_prompt(d, 100)
    assert d.num_computed_tokens == 0


def test_fork_shares_blocks_and_tail_is_copied_on_write():
    bm = manager()
    parent = Seq(list(range(6)))  # block 0 full, block 1 holds 2 tokens
    run_prompt(bm, parent)
    child = Seq(list(parent.token_ids))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.pool.blocks[b].ref_count == 2 for b in parent.block_table)
    used = bm.pool.num_used
    parent.token_ids.append(7)
    child.token_ids.append(8)
    copies = bm.append_slots(parent, 1)
    assert len(copies) == 1 and copies[0][0] == child.block_table[1]
    assert parent.block_table[1] != child.block_table[1] and parent.block_table[0] == child.block_table[0]
    assert bm.append_slots(child, 1) == []  # the child now owns the old tail alone
    assert bm.pool.num_used == used + 1
    bm.free(parent)
    bm.free(child)
    assert bm.pool.num_used == 0


def test_trim_releases_rejected_slots():
    bm = manager()
    seq = Seq(list(range(11)))
    run_prompt(bm, seq)
    assert len(seq.block_table) == 3
    bm.trim(seq, 5)
    assert seq.num_computed_tokens == 5 and len(seq.block_table) == 2 and len(seq.block_hashes) == 1
    assert bm.pool.num_used == 2


def test_release_below_zero_is_a_bug():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.release(block)
    with pytest.raises(AssertionError):
        pool.release(block)


def test_prefix_caching_off_never_hits():
    bm = manager(caching=False)
    a = Seq(list(range(12)))
    run_prompt(bm, a)
    b = Seq(list(range(12)))
    assert bm.allocate_prompt(b, 100) == 12


def test_prefix_keys_are_sha256_digests_so_python_hash_collisions_do_not_alias_blocks(monkeypatch):
    """CVE-2025-25183's construction: keys from Python's `hash`, which an attacker can collide. Here
    the builtin hash is made to collide on everything; keys must still differ for different prefixes."""
    monkeypatch.setattr(block_pool, "hash", lambda _: 0, raising=False)
    key_a = hash_block(None, (0, 1, 2, 3))
    key_b = hash_block(None, (0, 1, 2, 4))
    assert isinstance(key_a, bytes) and len(key_a) == 32 and key_a != key_b
    assert hash_block(key_a, (5, 6, 7, 8)) != hash_block(key_b, (5, 6, 7, 8))  # the parent is in the key


def test_a_later_block_with_equal_tokens_but_another_parent_is_never_a_hit():
    bm = manager()
    a = Seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prompt(bm, a)
    b = Seq([9, 9, 9, 9, 5, 6, 7, 8, 9])  # second block's tokens equal a's, its prefix does not
    assert bm.allocate_prompt(b, 100) == 9 and b.num_computed_tokens == 0


def test_cache_salt_separates_requests_and_equal_salts_share():
    bm = manager(num_blocks=16)
    run_prompt(bm, Seq(list(range(9)), cache_salt="tenant-a"))
    assert bm.allocate_prompt(Seq(list(range(9))), 100) == 9  # no salt: no hit on a salted block
    assert bm.allocate_prompt(Seq(list(range(9)), cache_salt="tenant-b"), 100) == 9
    same = Seq(list(range(9)), cache_salt="tenant-a")
    assert bm.allocate_prompt(same, 100) == 1 and same.num_computed_tokens == 8
