"""Continuous batching: which sequences run this step, and how many tokens each computes.

Every step, running sequences go first (oldest first), each taking what it lacks (one token when
decoding, a chunk when prefilling) under a token budget; waiting sequences join while budget and
seats remain. When the block pool runs dry, the newest running sequence is preempted: its blocks
are freed and it waits again at the front of the queue, to be recomputed (its full blocks usually
come straight back from the prefix cache).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..kv import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies to run first

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new_tokens: int, copies: list[tuple[int, int]] = ()) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.copies += copies

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_tokens_with_spec - seq.num_computed_tokens
            if seq.num_draft and n > budget:  # drafts that do not fit this step are dropped, not split
                seq.drop_drafts(keep=max(0, seq.num_draft - (n - budget)))
                n = seq.num_tokens_with_spec - seq.num_computed_tokens
            n = min(n, budget)
            if seq.num_draft and not self.block_manager.can_append(seq, n):  # drafts never cost a preemption
                n -= seq.num_draft
                seq.drop_drafts()
            while not self.block_manager.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.add(seq, n, self.block_manager.append_slots(seq, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            first_admission = seq.num_output_tokens == 0 and seq.first_token_time is None
            n = self.block_manager.allocate_prompt(seq, budget)
            if n == 0:
                break
            if first_admission:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.drop_drafts()
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def admit_running(self, seq: Sequence) -> None:
        """A sequence forked off a running one joins the running batch directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
