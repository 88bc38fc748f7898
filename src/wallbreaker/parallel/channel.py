"""Rank 0 -> workers: each step's inputs as two broadcasts on the control group, a fixed-size
header of counts and then every integer array of the step in one int64 payload."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine.model_runner import StepInputs
from ..layers.attention import AttentionMetadata, PrefillSpan
from ..layers.recurrent import StateMetadata, StateSpan

_STOP, _STEP = 0, 1
_HEADER = 12  # kind, tokens, paged sequences, table width, paged tokens, prefills, copies, logit rows (-1: all),
#               block size, payload, split by origin (batch invariance: the prefill spans are prompt tokens),
#               recurrent state spans (-1: the model has no recurrent layers)


class StepChannel:
    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.device = device

    def send(self, step: StepInputs) -> None:
        m = step.meta
        spans = [(s.start, s.length, s.context_len, len(s.block_table)) for s in m.prefills]
        rows = step.logit_rows
        states = m.state.spans if m.state is not None else []
        state_parts = [torch.tensor([x for s in states for x in (s.start, s.length, s.src, len(s.saves), s.src_root,
                                                                 s.src_entries, s.log_after)], dtype=torch.long),
                       torch.tensor([x for s in states for save in s.saves for x in save], dtype=torch.long)]
        parts = [step.input_ids, m.positions, m.slot_mapping, m.block_tables.flatten(), m.query_start, m.context_lens,
                 torch.tensor(spans, dtype=torch.long).flatten(), *(s.block_table for s in m.prefills),
                 torch.tensor(step.copies, dtype=torch.long).flatten(), rows if rows is not None else torch.empty(0),
                 *state_parts]
        payload = torch.cat([p.to("cpu", torch.long).flatten() for p in parts])
        header = torch.tensor([_STEP, len(step.input_ids), len(m.context_lens), m.block_tables.shape[1],
                               m.num_paged_tokens, len(spans), len(step.copies), -1 if rows is None else len(rows),
                               m.block_size, len(payload), int(m.split_by_origin),
                               -1 if m.state is None else len(states)])
        dist.broadcast(header, 0, group=self.group)
        dist.broadcast(payload, 0, group=self.group)

    def send_stop(self) -> None:
        dist.broadcast(torch.tensor([_STOP] + [0] * (_HEADER - 1)), 0, group=self.group)

    def recv(self) -> StepInputs | None:
        """The next step, or None when rank 0 stops the workers."""
        header = torch.empty(_HEADER, dtype=torch.long)
        dist.broadcast(header, 0, group=self.group)
        kind, tokens, paged, width, paged_tokens, n_spans, n_copies, n_rows, block_size, size, split, n_states = \
            header.tolist()
        if kind == _STOP:
            return None
        payload = torch.empty(size, dtype=torch.long)
        dist.broadcast(payload, 0, group=self.group)
        cursor = 0

        def take(n: int) -> torch.Tensor:
            nonlocal cursor
            cursor += n
            return payload[cursor - n:cursor].to(self.device)

        input_ids, positions, slots = take(tokens), take(tokens), take(tokens)
        tables = take(paged * width).view(paged, width).int()
        query_start, lens = take(paged + 1).int(), take(paged).int()
        spans = take(4 * n_spans).view(n_spans, 4).tolist()
        prefills = [PrefillSpan(start, length, context, take(table)) for start, length, context, table in spans]
        copies = [tuple(c) for c in take(2 * n_copies).view(n_copies, 2).tolist()]
        rows = None if n_rows < 0 else take(n_rows)
        state = None
        if n_states >= 0:
            heads = take(7 * n_states).view(n_states, 7).tolist()
            saves = take(2 * sum(h[3] for h in heads)).view(-1, 2).tolist()
            spans, at = [], 0
            for start, length, src, n_saves, root, entries, log_after in heads:
                spans.append(StateSpan(start, length, src, [tuple(x) for x in saves[at:at + n_saves]], root, entries,
                                       log_after))
                at += n_saves
            state = StateMetadata(spans)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, query_start=query_start, context_lens=lens,
                                 prefills=prefills, positions=positions, block_size=block_size,
                                 num_paged_tokens=paged_tokens, split_by_origin=bool(split), state=state)
        return StepInputs(input_ids, meta, copies, rows)
