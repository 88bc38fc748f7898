"""The state pool: the fixed-size states of recurrent layers, per sequence, beside the KV block pool.

Per recurrent layer one float32 tensor per state kind, [num_slots, *shape] (layers/recurrent.py);
a slot index reaches every layer's part, as a block id does in the KV pool. A sequence holds the
slot with its state after its computed tokens (`Sequence.state_slot`), and during a step the slots
the step writes (`Sequence.state_saves`): states are written out of place, so a slot once written
is never changed until it is free again. Sharing it is free: forks hold the same slot, and the
prefix cache keeps a slot as a checkpoint, keyed by the chained hash of the block it ends, by
holding a reference to it (unlike vLLM, which puts a state in one giant attention page).

Where a model's layers log drafts (`log_drafts`: Mamba2's SSM, layers/mamba2.py), the state after
a speculative draft is kept as a log: the slot holds the inputs of the drafts up to it, and its
state is that of a root slot (the state after the step's last verified token, written whole)
advanced by them. The logged slot holds a reference to its root until it is free again; a log is
never a checkpoint, so whatever reads a slot whole (a file, the disk tier) reads whole states.

Slot 0 is the zero state, never written, never freed. Free slots are reused last-freed first, so
the pages touched (the pool is lazily zeroed) stay those of the working set.
"""
from __future__ import annotations

import logging
import math
from collections import OrderedDict

import torch

from ..errors import InvalidRequestError
from ..layers.recurrent import ZERO_SLOT
from .cache import lazy_zeros

logger = logging.getLogger("wallbreaker.kv")


class StatePool:
    def __init__(self, layer_shapes: list[list[tuple[int, ...]]], num_slots: int, max_checkpoints: int,
                 device: torch.device | str = "cpu", log_drafts: int = 0):
        """`layer_shapes`: per recurrent layer, each state kind's shape for one sequence.
        `max_checkpoints`: slots the prefix cache may keep (its share of the pool). `log_drafts`: how
        many drafts a slot can hold as a log, where some layer keeps them so (0: none; the block
        manager then says which saves are logs)."""
        if num_slots < 2:
            raise ValueError("a state pool needs the zero slot and at least one more")
        self.layer_shapes = layer_shapes
        self.layers = [[lazy_zeros((num_slots, *shape), torch.float32, device) for shape in shapes]
                       for shapes in layer_shapes]
        self.num_slots = num_slots
        self.max_checkpoints = max_checkpoints
        self.ref_counts = [0] * num_slots
        self.ref_counts[ZERO_SLOT] = 1
        self._free = list(range(num_slots - 1, 0, -1))
        self.checkpoints: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recent first
        self.checkpoint_queries = 0
        self.checkpoint_hits = 0
        self.log_drafts = log_drafts
        self.logs: dict[int, tuple[int, int]] = {}  # logged slot -> (root slot, entries)

    def layer(self, i: int) -> list[torch.Tensor]:
        return self.layers[i]

    @property
    def slot_bytes(self) -> int:
        """One sequence's state across all layers."""
        return slot_bytes(self.layer_shapes)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def num_free(self) -> int:
        """Slots that `allocate` can give: free ones, and checkpoints no sequence holds."""
        return len(self._free) + sum(self.ref_counts[s] == 1 for s in self.checkpoints.values())

    @property
    def num_used(self) -> int:
        return self.num_slots - 1 - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            self._evict_checkpoint()
        slot = self._free.pop()
        self.ref_counts[slot] = 1
        return slot

    def log(self, slot: int, root: int, entries: int) -> None:
        """`slot` (being written by a step) holds the inputs of `entries` drafts after `root`'s state."""
        self.retain(root)
        self.logs[slot] = (root, entries)

    def log_of(self, slot: int) -> tuple[int, int]:
        """(root, entries) of a logged slot; (-1, 0) for one holding a whole state."""
        return self.logs.get(slot, (-1, 0))

    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """Copies of `slot`'s state in host memory, each layer's kinds in order: what a file of it holds."""
        assert slot not in self.logs, "a logged slot holds no whole state"
        return [t[slot].to("cpu", copy=True) for kinds in self.layers for t in kinds]

    def write_slot(self, slot: int, parts: list[torch.Tensor]) -> None:
        """Set `slot` (a fresh one, not yet read by a step) from `read_slot`'s parts."""
        for t, part in zip((t for kinds in self.layers for t in kinds), parts, strict=True):
            t[slot].copy_(part)

    @property
    def part_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(shape) for shapes in self.layer_shapes for shape in shapes]

    def restore_checkpoint(self, block_hash: bytes, parts: list[torch.Tensor]) -> int | None:
        """Keep a state read from a file as the checkpoint of `block_hash`; its slot, or None where
        no slot is free or checkpoints are off."""
        if self.max_checkpoints == 0 or self.num_free == 0:
            return None
        found = self.checkpoints.get(block_hash)
        if found is not None:
            return found
        slot = self.allocate()
        self.write_slot(slot, parts)
        self.checkpoint(block_hash, slot)
        self.release(slot)  # the checkpoint's reference is the one left
        return slot

    def retain(self, slot: int) -> None:
        if slot != ZERO_SLOT:
            self.ref_counts[slot] += 1

    def release(self, slot: int) -> None:
        if slot == ZERO_SLOT:
            return
        self.ref_counts[slot] -= 1
        assert self.ref_counts[slot] >= 0, f"state slot {slot} released more often than taken"
        if self.ref_counts[slot] == 0:
            self._free.append(slot)
            if slot in self.logs:
                self.release(self.logs.pop(slot)[0])

    # -- the prefix cache's checkpoints --------------------------------------------------------
    def checkpoint(self, block_hash: bytes, slot: int) -> None:
        """Keep `slot` as the state after the block `block_hash` ends (the hash chains all before it)."""
        if self.max_checkpoints == 0:
            return
        assert slot not in self.logs, "a checkpoint is a whole state"
        if block_hash in self.checkpoints:
            self.checkpoints.move_to_end(block_hash)
            return
        self.retain(slot)
        self.checkpoints[block_hash] = slot
        while len(self.checkpoints) > self.max_checkpoints:
            _, old = self.checkpoints.popitem(last=False)
            self.release(old)

    def lookup(self, block_hash: bytes) -> int | None:
        slot = self.checkpoints.get(block_hash)
        if slot is not None:
            self.checkpoints.move_to_end(block_hash)
        return slot

    def _evict_checkpoint(self) -> None:
        for block_hash, slot in self.checkpoints.items():
            if self.ref_counts[slot] == 1:
                del self.checkpoints[block_hash]
                self.release(slot)
                return
        raise RuntimeError("the state pool is exhausted (the scheduler checks num_free first)")

    def stats_dict(self) -> dict:
        return {"state_slots_used": self.num_used, "state_slots_total": self.num_slots - 1,
                "state_bytes": self.nbytes, "state_bytes_per_sequence": self.slot_bytes,
                "state_checkpoints": len(self.checkpoints), "state_checkpoint_hits": self.checkpoint_hits,
                "state_checkpoint_queries": self.checkpoint_queries}


def shard_state_pool(model: torch.nn.Module, sizes: tuple[int, int] | None, device: torch.device) -> StatePool | None:
    """A tensor-parallel rank's pool: as many slots as every rank's (`sizes`: slots, prefix-cache
    share), each of the shapes its own share of the recurrent layers keeps."""
    if sizes is None:
        return None
    return StatePool([m.state_shapes() for m in model.recurrent_layers()], *sizes, device, logs_drafts(model))


def logs_drafts(model: torch.nn.Module) -> int:
    """How many drafts every recurrent layer of `model` that logs them can hold (0: none logs)."""
    rooms = [m.logs_drafts for m in model.recurrent_layers() if getattr(m, "logs_drafts", 0)]
    return min(rooms, default=0)


def slot_bytes(layer_shapes: list[list[tuple[int, ...]]]) -> int:
    return sum(math.prod(s) * 4 for shapes in layer_shapes for s in shapes)


def slots_per_sequence(num_speculative_tokens: int) -> int:
    """What one running sequence may hold at once: its state (and, logged, its root), and in a step
    the state after each verified position (1 + drafts) and a prefix-cache checkpoint."""
    return 1 + (1 if num_speculative_tokens else 0) + 1 + num_speculative_tokens + 1


def size_state_pool(layer_shapes: list[list[tuple[int, ...]]], max_num_seqs: int, num_speculative_tokens: int,
                    max_checkpoints: int, budget_bytes: float) -> tuple[int, int]:
    """(slots, checkpoints) within `budget_bytes`: what `max_num_seqs` sequences need plus the
    prefix cache's share, or as many as fit (then fewer sequences run at once; the scheduler
    admits by free slots as by free blocks). Refused when not one sequence fits."""
    per = slot_bytes(layer_shapes)
    per_seq = slots_per_sequence(num_speculative_tokens)
    want = 1 + max_num_seqs * per_seq + max_checkpoints
    fit = int(budget_bytes // per) if per else want
    if fit >= want:
        return want, max_checkpoints
    if fit < 1 + per_seq:
        raise InvalidRequestError(
            f"the recurrent state of one sequence needs {(1 + per_seq) * per / 2**30:.3f} GB "
            f"({per / 2**20:.1f} MB a slot, {1 + per_seq} slots); raise kv_cache_memory_gb")
    checkpoints = min(max_checkpoints, (fit - 1) // 4)
    logger.warning("state pool: %d slots of %.1f MB fit the budget, for %d sequences at once (max_num_seqs %d); "
                   "raise kv_cache_memory_gb for more", fit, per / 2**20, (fit - 1 - checkpoints) // per_seq,
                   max_num_seqs)
    return fit, checkpoints
