"""The logical side of the paged KV cache: each sequence's block table, grown on demand.

A sequence holds `block_table` (physical block ids, in order) and `block_hashes` (the chained
digest of each of its full blocks, the first chained to its `cache_salt`). Full blocks are
immutable and may be shared (prefix cache hits, forks); only a sequence's partly filled tail
block is ever written, so that is the one place copy-on-write is needed.

A model with recurrent layers also has a state pool (kv/state_pool.py), kept here beside the
blocks: a sequence's `state_slot` moves with its computed tokens. Each step writes its states to
fresh slots (`state_saves`, taken when the step's room is), and `commit` keeps the one at the
tokens computed; a prompt's last block boundary is checkpointed for the prefix cache (and written
to the disk tier), and a prefix hit starts from the deepest cached block that has a checkpoint, in
RAM or on disk.
"""
from __future__ import annotations

from typing import Callable, Iterator, Protocol

import torch

from ..layers.recurrent import MAX_STEP_TOKENS, ZERO_SLOT
from .block_pool import Block, BlockPool, hash_block, salt_digest
from .state_pool import StatePool


class PagedSequence(Protocol):
    token_ids: list[int]
    num_prompt_tokens: int
    num_prefill_path_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    block_hashes: list[bytes]
    cache_salt: str | None
    spec_token_ids: list[int]
    state_slot: int
    state_saves: list[tuple[int, int]]
    state_checkpoint_at: int
    state_src_log: tuple[int, int]
    state_log_after: int


class BlockStore(Protocol):
    """A tier below the RAM prefix cache (kv/disk_cache.py): full blocks' pages by key."""

    def store(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None: ...
    def load(self, block_hash: bytes, token_ids: tuple[int, ...]) -> list[torch.Tensor] | None: ...
    def write_block(self, block_id: int, parts: list[torch.Tensor]) -> None: ...
    def store_state(self, block_hash: bytes, read_state: Callable[[], list[torch.Tensor]], nbytes: int) -> None: ...
    def load_state(self, block_hash: bytes, shapes: list[tuple[int, ...]]) -> list[torch.Tensor] | None: ...
    def stats_dict(self) -> dict: ...
    def set_engine_idle(self, idle: bool) -> None: ...


class BlockManager:
    def __init__(self, pool: BlockPool, block_size: int, disk: BlockStore | None = None,
                 states: StatePool | None = None, origin_keys: bool = False):
        """`disk`: where full blocks are also kept, and looked for when the RAM cache misses.
        `states`: the recurrent layers' state pool, where the model has any. `origin_keys`: a block's
        key also says how many of its tokens were prompt tokens (batch-invariant mode: `hash_block`)."""
        self.pool = pool
        self.block_size = block_size
        self.origin_keys = origin_keys
        self.disk = disk if pool.enable_prefix_caching else None
        self.states = states

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prompt_blocks(self, token_ids: list[int], cache_salt: str | None, num_tokens: int | None = None,
                      num_prompt_tokens: int | None = None, images: tuple = (),
                      adapter: bytes | None = None) -> Iterator[tuple[bytes, tuple[int, ...]]]:
        """(chained hash, tokens) of each full block of the first `num_tokens` tokens (default: all
        but the last, whose logits are needed, so at least it is computed again), of which the first
        `num_prompt_tokens` were the prompt (default: all). `images`: the prompt's images (their
        `offset`, `end` and pixel `digest`), which key the blocks holding their soft tokens. `adapter`:
        the key of the LoRA adapter the tokens are computed with (None: the base model)."""
        end = len(token_ids) - 1 if num_tokens is None else num_tokens
        parent = salt_digest(cache_salt, adapter)
        for i in range(end // self.block_size):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = hash_block(parent, tokens, self._prompt_in(i, num_prompt_tokens), self._images_in(i, images))
            yield parent, tokens

    def _images_in(self, block: int, images: tuple) -> bytes:
        """What keys the `block`-th block besides its tokens: the pixel digest of each image whose soft
        tokens it holds, and where the image starts relative to the block. An image's placeholder
        tokens are the same for every image; its pixels are not."""
        lo, hi = block * self.block_size, (block + 1) * self.block_size
        return b"".join(image.digest + (image.offset - lo).to_bytes(8, "little", signed=True)
                        for image in images if image.offset < hi and image.end > lo)

    def _num_prompt(self, seq: PagedSequence) -> int | None:
        """Its tokens computed as prompt (on the prefill path), for its blocks' keys."""
        return seq.num_prefill_path_tokens if self.origin_keys else None

    def _prompt_in(self, block: int, num_prompt_tokens: int | None) -> int | None:
        """The prompt tokens of the `block`-th block, for its key (None: not part of the key)."""
        if not self.origin_keys or num_prompt_tokens is None:
            return None
        return min(max(num_prompt_tokens - block * self.block_size, 0), self.block_size)

    def cached_prefix(self, seq: PagedSequence) -> list[Block]:
        """Cached full blocks matching the start of `seq` in RAM. The last token is never covered."""
        blocks: list[Block] = []
        for block_hash, tokens in self.prompt_blocks(seq.token_ids, seq.cache_salt,
                                                     num_prompt_tokens=self._num_prompt(seq),
                                                     images=getattr(seq, "images", ()),
                                                     adapter=getattr(seq, "lora_key", None)):
            block = self.pool.lookup(block_hash, tokens)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _load_from_disk(self, seq: PagedSequence, start: int) -> list[Block]:
        """The blocks of `seq` from its `start`-th on, read from the disk tier while they are found and
        the pool has room; each taken (ref_count 1) and registered in the RAM cache."""
        loaded: list[Block] = []
        for i, (block_hash, tokens) in enumerate(self.prompt_blocks(seq.token_ids, seq.cache_salt,
                                                                    num_prompt_tokens=self._num_prompt(seq),
                                                                    images=getattr(seq, "images", ()),
                                                                    adapter=getattr(seq, "lora_key", None))):
            if i < start:
                continue
            if self.pool.num_free <= 1:
                break
            parts = self.disk.load(block_hash, tokens)
            if parts is None:
                break
            block = self.pool.allocate()
            self.disk.write_block(block.block_id, parts)
            self.pool.register(block, block_hash, tokens)
            loaded.append(block)
        return loaded

    def allocate_prompt(self, seq: PagedSequence, max_new_tokens: int, reuse_prefix: bool = True) -> int:
        """Start a sequence that holds no blocks: reuse its cached prefix (from RAM, then from the disk
        tier), then take blocks for up to `max_new_tokens` more tokens. Returns the number of tokens
        to compute now (0: no room; blocks read from disk then stay in the RAM cache)."""
        assert not seq.block_table
        hits = self.cached_prefix(seq) if reuse_prefix and self.pool.enable_prefix_caching else []
        for block in hits:  # held first, so that reading from disk cannot evict them
            self.pool.retain(block)
        if reuse_prefix and self.disk is not None and len(hits) < (len(seq.token_ids) - 1) // self.block_size:
            hits += self._load_from_disk(seq, len(hits))
        state = ZERO_SLOT
        if self.states is not None:
            hits, state = self._deepest_checkpoint(hits)
            self.states.retain(state)  # held first, so that the fit below does not count it as free
        computed = len(hits) * self.block_size
        num_new = min(len(seq.token_ids) - computed, max_new_tokens)
        fit = getattr(seq, "fit_chunk", None)  # a prompt with images: never part of an image's block
        if fit is not None:
            num_new = fit(computed, num_new)
        if (self.blocks_needed(computed + num_new) - len(hits) > self.pool.num_free
                or not self._states_fit(seq, computed, num_new)):
            for block in reversed(hits):
                self.pool.release(block)
            if self.states is not None:
                self.states.release(state)
            return 0
        seq.block_table = [b.block_id for b in hits]
        seq.block_hashes = [b.hash for b in hits]
        seq.num_computed_tokens = computed
        self._grow(seq, computed + num_new)
        if self.states is not None:
            seq.state_slot = state
            self._reserve_states(seq, num_new)
        return num_new

    def _deepest_checkpoint(self, hits: list[Block]) -> tuple[list[Block], int]:
        """The cached blocks to reuse, cut back to the deepest one whose end has a state checkpoint
        (the rest released), and that checkpoint's slot (the zero slot where none has)."""
        states = self.states
        keep, slot = 0, ZERO_SLOT
        if hits:
            states.checkpoint_queries += 1
        for i in range(len(hits), 0, -1):
            found = states.lookup(hits[i - 1].hash)
            if found is None and self.disk is not None:
                found = self._state_from_disk(hits[i - 1].hash)
            if found is not None:
                keep, slot = i, found
                states.checkpoint_hits += 1
                break
        for block in reversed(hits[keep:]):
            self.pool.release(block)
        return hits[:keep], slot

    def _state_from_disk(self, block_hash: bytes) -> int | None:
        """The disk tier's state after the block `block_hash`, made a checkpoint (its slot)."""
        if self.states.max_checkpoints == 0 or self.states.num_free == 0:
            return None
        parts = self.disk.load_state(block_hash, self.states.part_shapes)
        return None if parts is None else self.states.restore_checkpoint(block_hash, parts)

    def _state_saves_needed(self, seq: PagedSequence, computed: int, num_new: int, num_draft: int) -> list[int]:
        """The k (tokens into the step) after which a step of `num_new` tokens from `computed`, the
        last `num_draft` of them drafts, must keep the state: after the last token, or after each
        verified position; and at the prompt's last block boundary, for the prefix cache."""
        ks = list(range(num_new - num_draft, num_new + 1)) if num_draft else [num_new]
        if self.pool.enable_prefix_caching and self.states.max_checkpoints:
            boundary = (len(seq.token_ids) - 1) // self.block_size * self.block_size
            if computed < boundary < computed + num_new - num_draft:
                ks.insert(0, boundary - computed)
        return ks

    def _states_fit(self, seq: PagedSequence, computed: int, num_new: int) -> bool:
        if self.states is None:
            return True
        needed = self._state_saves_needed(seq, computed, num_new, len(seq.spec_token_ids))
        return len(needed) <= self.states.num_free

    def _reserve_states(self, seq: PagedSequence, num_new: int) -> None:
        """The step's saves; where the pool logs drafts, those after a draft are logs rooted at the save
        after the last verified token (kv/state_pool.py)."""
        computed, num_draft = seq.num_computed_tokens, len(seq.spec_token_ids)
        ks = self._state_saves_needed(seq, computed, num_new, num_draft)
        seq.state_saves = [(k, self.states.allocate()) for k in ks]
        seq.state_src_log = self.states.log_of(seq.state_slot)
        seq.state_log_after = 0
        if 0 < num_draft <= self.states.log_drafts and num_new <= MAX_STEP_TOKENS:
            seq.state_log_after = root_k = num_new - num_draft
            root = dict(seq.state_saves)[root_k]
            for k, slot in seq.state_saves:
                if k > root_k:
                    self.states.log(slot, root, k - root_k)
        boundary = (len(seq.token_ids) - 1) // self.block_size * self.block_size
        seq.state_checkpoint_at = boundary if any(computed + k == boundary for k in ks) and boundary else 0

    def _commit_state(self, seq: PagedSequence, num_new_tokens: int) -> None:
        """Keep the state after `num_new_tokens` of the step (and a checkpoint that is part of what was
        computed); the other slots the step wrote go back."""
        states = self.states
        start = seq.num_computed_tokens - num_new_tokens
        kept = None
        for k, slot in seq.state_saves:
            if k == num_new_tokens:
                kept = slot
            if seq.state_checkpoint_at and start + k == seq.state_checkpoint_at and k <= num_new_tokens:
                block_hash = seq.block_hashes[seq.state_checkpoint_at // self.block_size - 1]
                states.checkpoint(block_hash, slot)
                if self.disk is not None and block_hash in states.checkpoints:
                    self.disk.store_state(block_hash, lambda s=slot: states.read_slot(s), states.slot_bytes)
        assert kept is not None, f"no state was kept after {num_new_tokens} tokens of the step"
        states.retain(kept)
        states.release(seq.state_slot)
        seq.state_slot = kept
        self._drop_saves(seq)

    def _drop_saves(self, seq: PagedSequence) -> None:
        for _, slot in seq.state_saves:
            self.states.release(slot)
        seq.state_saves = []
        seq.state_checkpoint_at = 0
        seq.state_log_after = 0

    def can_append(self, seq: PagedSequence, num_new_tokens: int) -> bool:
        end = seq.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(end) - len(seq.block_table)
        if self._tail_is_shared(seq):
            need += 1
        return need <= self.pool.num_free and self._states_fit(seq, seq.num_computed_tokens, num_new_tokens)

    def append_slots(self, seq: PagedSequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for the next `num_new_tokens` tokens (check `can_append` first). Returns the
        (src, dst) block copies to run before the step: a shared tail block is copied on write."""
        copies = []
        if self._tail_is_shared(seq):
            index = seq.num_computed_tokens // self.block_size
            old = self.pool.blocks[seq.block_table[index]]
            new = self.pool.allocate()
            self.pool.release(old)
            seq.block_table[index] = new.block_id
            copies.append((old.block_id, new.block_id))
        self._grow(seq, seq.num_computed_tokens + num_new_tokens)
        if self.states is not None:
            self._reserve_states(seq, num_new_tokens)
        return copies

    def commit(self, seq: PagedSequence, num_new_tokens: int) -> None:
        """The step computed these tokens: advance, and offer every newly full block to the prefix cache
        (and to the disk tier, which writes the blocks the RAM cache takes)."""
        seq.num_computed_tokens += num_new_tokens
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else salt_digest(seq.cache_salt, getattr(seq, "lora_key", None))
            block_hash = hash_block(parent, tokens, self._prompt_in(i, self._num_prompt(seq)),
                                    self._images_in(i, getattr(seq, "images", ())))
            seq.block_hashes.append(block_hash)
            block = self.pool.blocks[seq.block_table[i]]
            if self.pool.register(block, block_hash, tokens) and self.disk is not None:
                self.disk.store(block.block_id, block_hash, tokens)
        if self.states is not None and seq.state_saves:
            self._commit_state(seq, num_new_tokens)

    def fork(self, parent: PagedSequence, child: PagedSequence) -> None:
        """`child` shares every block of `parent`; the first write to a shared tail copies it."""
        for block_id in parent.block_table:
            self.pool.retain(self.pool.blocks[block_id])
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        if self.states is not None:
            self.states.retain(parent.state_slot)
            child.state_slot = parent.state_slot

    def trim(self, seq: PagedSequence, num_tokens: int) -> None:
        """Forget K/V past `num_tokens` (rejected speculative tokens, a failed step): whole blocks
        beyond are freed. A recurrent state cannot go back: only what a step had not committed is
        dropped (its saves)."""
        if self.states is not None:
            if num_tokens < seq.num_computed_tokens:
                raise RuntimeError("a recurrent state cannot be rolled back past its computed tokens")
            self._drop_saves(seq)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block_id in seq.block_table[keep:]:
            self.pool.release(self.pool.blocks[block_id])
        del seq.block_table[keep:]
        del seq.block_hashes[seq.num_computed_tokens // self.block_size:]

    def free(self, seq: PagedSequence) -> None:
        for block_id in reversed(seq.block_table):
            self.pool.release(self.pool.blocks[block_id])
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        if self.states is not None:
            self._drop_saves(seq)
            self.states.release(seq.state_slot)
            seq.state_slot = ZERO_SLOT

    def _tail_is_shared(self, seq: PagedSequence) -> bool:
        if seq.num_computed_tokens % self.block_size == 0:
            return False
        tail = self.pool.blocks[seq.block_table[seq.num_computed_tokens // self.block_size]]
        return tail.ref_count > 1

    def _grow(self, seq: PagedSequence, num_tokens: int) -> None:
        while len(seq.block_table) < self.blocks_needed(num_tokens):
            seq.block_table.append(self.pool.allocate().block_id)
