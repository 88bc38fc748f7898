"""Continuous batching, and the one owner of sequences and their KV blocks between steps.

`schedule` decides which sequences run this step and how many tokens each computes. Every step,
running sequences go first (oldest first), each taking what it lacks (one token when decoding, a
chunk when prefilling) under a token budget; waiting sequences join while budget and seats remain. When the block pool runs dry, the newest running sequence is preempted: its blocks
are freed and it waits again at the front of the queue, to be recomputed (its full blocks usually
come straight back from the prefix cache).

`update_from_output` is a step's whole aftermath, as nano-vllm's `postprocess` and vLLM's
`update_from_output` are: what the step computed is committed (full blocks offered to the prefix
cache), forks take their blocks, tokens are appended, rejected drafts' slots are trimmed, finished
sequences are freed. No one else changes a block table after a step. Drivers that run sequences
outside the queues (beam search, scoring, a draft model) ask `schedule_these` for room and hand
their step to `update_from_output` the same way.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..kv import BlockManager
from ..kv.disk_cache import DiskStats
from .outputs import StreamDelta
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


@dataclass
class Append:
    """Tokens a step adds to a sequence: one sampled, or the drafts verification kept and the
    target's own token after them."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    mirostat_mu: float | None = None  # the sampler's state after this draw, where it keeps one


@dataclass
class StepOutput:
    """What the engine made of one model step."""

    computed: bool = True  # False: the step failed; nothing it wrote is kept and its sequences run again
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child): n > 1 at the first sample
    appends: list[Append] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # of requests that failed: finished with "error"
    pooled: list[Sequence] = field(default_factory=list)  # pooling sequences computed this step: finished


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
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
            if seq.pooling and n > budget and batch.seqs:  # whole or not at all (a step that failed left it here)
                i += 1
                continue
            if seq.num_draft and n > budget:  # drafts that do not fit this step are dropped, not split
                seq.drop_drafts(keep=max(0, seq.num_draft - (n - budget)))
                n = seq.num_tokens_with_spec - seq.num_computed_tokens
            if not seq.pooling:
                n = seq.fit_chunk(seq.num_computed_tokens, min(n, budget))
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
        admitted = False
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            first_admission = seq.num_output_tokens == 0 and seq.first_token_time is None
            if seq.pooling:  # whole, never from the prefix cache (every position's hidden state is needed);
                # past the budget only as the step's first admission: beside the running sequences' own
                # tokens, never behind them for ever, and never holding back the queue
                if seq.num_tokens > budget and admitted:
                    break
                n = self.block_manager.allocate_prompt(seq, seq.num_tokens, reuse_prefix=False)
            else:
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
            admitted = True
        self._tell_disk()
        return batch

    def _tell_disk(self) -> None:
        """The disk tier writes while the engine has nothing to compute (kv/disk_cache.py)."""
        if self.block_manager.disk is not None:
            self.block_manager.disk.set_engine_idle(not self.has_unfinished())

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.drop_drafts()
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule_these(self, seqs: list[Sequence], max_new_tokens: int | None = None,
                       reuse_prefix: bool = True) -> ScheduledBatch:
        """Room for sequences a driver runs outside the queues (beam search, scoring, a draft model),
        each for the tokens it lacks, at most `max_new_tokens`: one holding no blocks starts (its cached
        prefix reused, unless every position must be computed), one holding blocks appends. A sequence
        the pool has no room for is left out of the batch."""
        bm = self.block_manager
        batch = ScheduledBatch()
        for seq in seqs:
            n = seq.num_tokens - seq.num_computed_tokens
            if max_new_tokens is not None:
                n = min(n, max_new_tokens)
            fit = getattr(seq, "fit_chunk", None)  # never part of an image's block (allocate_prompt fits its own)
            if fit is not None and seq.block_table:
                n = fit(seq.num_computed_tokens, n)
            if not seq.block_table:
                n = bm.allocate_prompt(seq, n, reuse_prefix)
                if n:
                    batch.add(seq, n)
            elif bm.can_append(seq, n):
                batch.add(seq, n, bm.append_slots(seq, n))
        return batch

    def update_from_output(self, batch: ScheduledBatch, output: StepOutput) -> list[StreamDelta]:
        """A step's aftermath (see the module docstring); the deltas to stream."""
        bm = self.block_manager
        scheduled = dict(zip(batch.seqs, batch.num_new_tokens))
        for seq, n in scheduled.items():
            if seq.is_finished:
                continue
            if not output.computed:  # the slots taken for this step go back; the next one redoes it
                bm.trim(seq, seq.num_computed_tokens)
            elif not seq.num_draft:  # drafts are committed below, as far as they are accepted
                bm.commit(seq, n)
        for parent, child in output.forks:
            parent.pending_fork = 0
            bm.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        deltas = []
        for seq in output.failed:
            if not seq.is_finished:
                self.finish(seq, "error")
                deltas.append(StreamDelta(seq.request_id, seq.index, "", [], [], [], "error"))
        for seq in output.pooled:  # its pages go back at once
            if not seq.is_finished:
                self.finish(seq, "stop")
                deltas.append(StreamDelta(seq.request_id, seq.index, "", [], [], [], "stop"))
        for a in output.appends:
            seq = a.seq
            if seq.is_finished:
                continue
            num_draft, computed = seq.num_draft, seq.num_computed_tokens
            if a.mirostat_mu is not None:
                seq.mirostat_mu = a.mirostat_mu
            delta = seq.append(a.tokens, a.logprobs, a.top_logprobs, self.max_model_len)
            deltas.append(delta)
            if num_draft:
                seq.record_verification(num_draft, len(a.tokens) - 1)
            if delta.finish_reason is not None:
                self.finish(seq, delta.finish_reason)
            elif num_draft:  # keep the accepted drafts' K/V; release the rest
                computed += scheduled[seq] - num_draft + len(a.tokens) - 1
                bm.commit(seq, computed - seq.num_computed_tokens)
                bm.trim(seq, computed)
        for seq in batch.seqs + self.running:  # verified, or not scheduled: either way done with
            seq.drop_drafts()
        self._tell_disk()
        return deltas

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._tell_disk()

    def live_stats(self) -> dict:
        pool = self.block_manager.pool
        disk = self.block_manager.disk
        states = self.block_manager.states
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_blocks_used": pool.num_used, "kv_blocks_total": pool.num_blocks,
                **(disk.stats_dict() if disk is not None else DiskStats().as_dict()),
                **(states.stats_dict() if states is not None else {})}

    def stats(self) -> dict:
        """The queues and the pool: blocks, the tokens they hold, the share of slots wasted (the
        unfilled tails of the running sequences' blocks), prefix-cache hits."""
        pool = self.block_manager.pool
        bs = self.block_manager.block_size
        filled: dict[int, int] = {}
        for seq in self.running:
            for i, block_id in enumerate(seq.block_table):
                filled[block_id] = max(filled.get(block_id, 0), min(bs, max(seq.num_computed_tokens - i * bs, 0)))
        slots = len(filled) * bs
        stored = sum(filled.values())
        return {**self.live_stats(), "kv_blocks_free": pool.num_free, "kv_block_size": bs,
                "kv_tokens_stored": stored, "kv_waste_fraction": 1.0 - stored / slots if slots else 0.0,
                "prefix_cache_queries": pool.prefix_queries, "prefix_cache_hits": pool.prefix_hits,
                "num_preemptions": self.num_preemptions}

    # -- for drivers whose sequences are outside the queues --------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (a beam); the first write to a shared tail copies it."""
        self.block_manager.fork(parent, child)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Forget `seq`'s K/V past `num_tokens` (a draft model's tokens its target did not keep)."""
        self.block_manager.trim(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
