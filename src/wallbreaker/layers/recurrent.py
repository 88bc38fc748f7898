"""Recurrent layers: a fixed-size state per sequence instead of a KV cache that grows.

A short convolution (LFM2), a Mamba2 mixer (Granite-4.0-H, Mamba2) and a gated delta net
(Qwen3-Next) each keep, per sequence, a few tensors that sum up everything before the next token.
They live in the state pool (kv/state_pool.py): per recurrent layer, one tensor per state kind,
[num_slots, *shape]. A sequence holds a slot as it holds a block table.

States are written out of place. A step reads a sequence's state from one slot (`StateSpan.src`)
and writes the states it must keep to others (`StateSpan.saves`); the scheduler then commits one
of them and lets the old one go. So a failed step retried alone is exact, forks share a slot
(copy-on-write for free: no one writes a slot that is read), speculative verification keeps
the state after each draft (or, for Mamba2's SSM, a log of the drafts' inputs: kv/state_pool.py)
and commits the one of the drafts accepted (no re-decoding), and the prefix cache keeps a slot as
a checkpoint by holding a reference to it.

Slot 0 is all zeros and never written: the state before a sequence's first token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .direct import DirectModule

ZERO_SLOT = 0  # never written: every state kind is zero there, the state of an empty prefix


@dataclass
class StateSpan:
    """One sequence's rows of a step, for its recurrent layers."""

    start: int  # first of its rows in the flat batch
    length: int  # rows (tokens) computed this step
    src: int  # slot holding the state before its first row (ZERO_SLOT: nothing before it)
    saves: list[tuple[int, int]]  # (k, slot), k ascending in 1..length: the state after its first k rows goes to slot
    # logged states (layers that `logs_drafts`; kv/state_pool.py): src is the state of slot `src_root`
    # advanced by the `src_entries` tokens logged in src (-1, 0: src holds a whole state); saves with
    # k > `log_after` (0: none) are logged, rooted at the save with k == log_after
    src_root: int = -1
    src_entries: int = 0
    log_after: int = 0


@dataclass
class StateMetadata:
    """Where each sequence of a step reads and writes its recurrent state: one span per sequence,
    in row order, covering every row of the flat batch."""

    spans: list[StateSpan]
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def one_token_each(self) -> bool:
        """Every sequence computes one token and keeps the state after it (a plain decode step)."""
        if "one" not in self._memo:
            self._memo["one"] = all(s.length == 1 and len(s.saves) == 1 for s in self.spans)
        return self._memo["one"]

    def logged(self, spans: list[StateSpan], device: torch.device) -> torch.Tensor | None:
        """[B, 3] int64 (root slot, src's entries, first logged row) of `spans`, for a kernel that
        reads and writes logged states (`_C.ssm_step`); None where no span has any."""
        if all(s.src_root < 0 and not s.log_after for s in spans):
            return None
        return torch.tensor([(s.src_root, s.src_entries, s.log_after or s.length) for s in spans], device=device)

    def slots(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[B] source slots and [B] destination slots of a one-token-each step."""
        if "slots" not in self._memo:
            self._memo["slots"] = (torch.tensor([s.src for s in self.spans], device=device),
                                   torch.tensor([s.saves[0][1] for s in self.spans], device=device))
        return self._memo["slots"]


# step: (inputs, each [B, ...]; states, each [B, *shape]) -> (outputs [B, ...], new states); one token per row
# chunk: (inputs, each [L, ...] of one sequence; states, each [1, *shape]) -> (outputs [L, ...], new states)
StepFn = Callable[[tuple[torch.Tensor, ...], list[torch.Tensor]], tuple[torch.Tensor, list[torch.Tensor]]]
ChunkFn = StepFn
# step_in_pool: (inputs, each [B, T, ...]; src [B] slots; dst [B, T] slots, -1 where not kept) -> outputs
# [B, T, ...]: T tokens of each sequence, token by token, from the pool's src slots, writing the state
# after token t to slot dst[b, t] itself (C++: csrc/recurrent_ops.cpp), with no gather or scatter copies;
# a layer that logs drafts takes a fourth argument, StateMetadata.logged's
StepInPoolFn = Callable[..., torch.Tensor]
MAX_STEP_TOKENS = 16  # a span this short goes to step_in_pool (decode, verification, a short prompt)


def scan_spans(meta: StateMetadata, pool: list[torch.Tensor], inputs: tuple[torch.Tensor, ...],
               step: StepFn, chunk: ChunkFn, step_in_pool: StepInPoolFn | None = None,
               logs: bool = False) -> torch.Tensor:
    """Run a recurrence over a step's rows: `inputs` are per-row tensors [T, ...] (what the layer's
    input projection made), `pool` the layer's state tensors [num_slots, *shape]. Returns the
    per-row outputs [T, ...], in row order.

    `step` is the one-token form (a decode step: every sequence at once), `chunk` the form for
    many tokens of one sequence (prefill). Neither may write the states it is given. A span is cut
    at its save points; each piece runs from the state the previous one ended with. Where the layer
    has `step_in_pool`, spans of at most MAX_STEP_TOKENS go to it instead, grouped by length; with
    `logs`, it reads and writes logged states, which no other form can."""
    if step_in_pool is not None:
        return _scan_in_pool(meta, pool, inputs, step, chunk, step_in_pool, logs)
    if meta.one_token_each:
        src, dst = meta.slots(inputs[0].device)
        out, new = step(inputs, [p[src] for p in pool])
        for p, n in zip(pool, new):
            p[dst] = n.to(p.dtype)
        return out
    return torch.cat([_scan_span(span, pool, inputs, step, chunk) for span in meta.spans])


def _scan_span(span: StateSpan, pool: list[torch.Tensor], inputs: tuple[torch.Tensor, ...], step: StepFn,
               chunk: ChunkFn, logs: bool = False) -> torch.Tensor:
    if logs and (span.src_root >= 0 or span.log_after):
        raise RuntimeError(f"a logged state reached a span of {span.length} tokens, past what the layer's "
                           f"kernel runs ({MAX_STEP_TOKENS}); the block manager logs only shorter steps")
    outs: list[torch.Tensor] = []
    states = [p[span.src:span.src + 1] for p in pool]
    done = 0
    for k, slot in [*span.saves, (span.length, -1)]:
        if k > done:
            rows = slice(span.start + done, span.start + k)
            out, states = (step if k - done == 1 else chunk)(tuple(x[rows] for x in inputs), states)
            outs.append(out)
            done = k
        if slot >= 0:
            for p, s in zip(pool, states):
                p[slot] = s[0].to(p.dtype)
    return torch.cat(outs)


def _scan_in_pool(meta: StateMetadata, pool: list[torch.Tensor], inputs: tuple[torch.Tensor, ...], step: StepFn,
                  chunk: ChunkFn, step_in_pool: StepInPoolFn, logs: bool) -> torch.Tensor:
    device = inputs[0].device

    def run(shaped: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor, logged: torch.Tensor | None) -> torch.Tensor:
        if logs:
            return step_in_pool(shaped, src, dst, logged).flatten(0, 1)
        return step_in_pool(shaped, src, dst).flatten(0, 1)

    if meta.one_token_each:
        src, dst = meta.slots(device)
        if logs and "logged" not in meta._memo:
            meta._memo["logged"] = meta.logged(meta.spans, device)
        return run(tuple(x[:, None] for x in inputs), src, dst[:, None], meta._memo.get("logged"))
    groups = meta._memo.get("groups")
    if groups is None:  # per span length: (rows [B * T], src [B], dst [B, T], logged), shared by every layer
        by_length: dict[int, list[StateSpan]] = {}
        for span in meta.spans:
            if span.length <= MAX_STEP_TOKENS:
                by_length.setdefault(span.length, []).append(span)
        groups, in_order = [], False
        for length, spans in by_length.items():
            dst = torch.full((len(spans), length), -1, dtype=torch.long)
            for b, span in enumerate(spans):
                for k, slot in span.saves:
                    dst[b, k - 1] = slot
            starts = [s.start + t for s in spans for t in range(length)]
            rows = torch.tensor(starts, device=device)
            groups.append((rows, torch.tensor([s.src for s in spans], device=device), dst.to(device),
                           meta.logged(spans, device)))
            in_order = starts == list(range(inputs[0].shape[0]))
        # every row in one group, in row order (a verification, equal spans side by side): no gather
        # of the inputs and no scatter of the outputs
        meta._memo["groups"] = groups
        meta._memo["whole"] = len(groups) == 1 and in_order
    if meta._memo["whole"]:
        _, src, dst, logged = groups[0]
        return run(tuple(x.reshape(*dst.shape, *x.shape[1:]) for x in inputs), src, dst, logged)
    parts: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
    for rows, src, dst, logged in groups:
        parts.append((rows, run(tuple(x[rows].view(*dst.shape, *x.shape[1:]) for x in inputs), src, dst, logged)))
    for span in meta.spans:
        if span.length > MAX_STEP_TOKENS:
            parts.append((slice(span.start, span.start + span.length), _scan_span(span, pool, inputs, step, chunk, logs)))
    out = parts[0][1].new_empty(inputs[0].shape[0], *parts[0][1].shape[1:])
    for rows, y in parts:
        out[rows] = y
    return out


class RecurrentMixer(DirectModule):
    """The part of a layer that keeps a state (where another layer has attention). The runner binds
    `state` to this layer's tensors in the state pool, as it binds an attention layer's `kv`."""

    state: list[torch.Tensor] | None = None  # per state kind, [num_slots, *shape]

    def state_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each state kind for one sequence (float32), in the order of `state`."""
        raise NotImplementedError
