"""LoRA beside a linear layer's matmul, not merged into it: y = base(x) + (x Aᵀ) Bᵀ for the rows whose
sequence uses the adapter, each sequence its own adapter (vLLM's punica idea, as grouped small
matmuls in torch: one pair of matmuls per adapter present in the step, whatever the number of its rows).

The layers of a model share one `LoRARows`, which the model runner sets each step (engine/
model_runner.py) as it sets `PromptRows`: which rows use which adapter slot. A layer holds its share of
each bound adapter as one `LoRAWeights` a slot (lora/registry.py binds them): the A of its fused
segments stacked, B block-diagonal over them with the scale folded in, so a fused q|k|v or gate|up
layer is one pair of matmuls too."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

INVARIANT_LORA_ROWS = 16  # rows of every LoRA matmul call in batch-invariant mode (layers/linear.py)


@dataclass
class LoRAWeights:
    a: torch.Tensor  # [R, in] float32, R = the ranks of the layer's targeted segments together
    b: torch.Tensor  # [out, R] float32, block-diagonal over the segments, times the adapter's scale


@dataclass
class LoRARows:
    """The step's (adapter slot, rows) groups: rows a slice of the step or an index tensor; empty
    between steps and in a step without adapters. One object shared by a model's layers."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


def row_groups(pieces: list[tuple[int, int]], device: torch.device) -> list[tuple[int, slice | torch.Tensor]]:
    """(slot, rows) groups of a step whose consecutive row runs are `pieces`, (slot, number of rows)
    each, slot 0 meaning no adapter: one group per adapter present."""
    runs: dict[int, list[tuple[int, int]]] = {}
    row = 0
    for slot, n in pieces:
        if slot and n:
            runs.setdefault(slot, []).append((row, row + n))
        row += n
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for slot, spans in runs.items():
        if all(a == b for (_, a), (b, _) in zip(spans, spans[1:])):  # one contiguous run
            groups.append((slot, slice(spans[0][0], spans[-1][1])))
        else:
            groups.append((slot, torch.cat([torch.arange(a, b) for a, b in spans]).to(device)))
    return groups


def _delta(x: torch.Tensor, w: LoRAWeights, invariant: bool) -> torch.Tensor:
    """[n, out] (x Aᵀ) Bᵀ; in batch-invariant mode in calls of exactly INVARIANT_LORA_ROWS rows, so a
    row's bits do not depend on how many rows share its adapter."""
    if not invariant:
        return (x @ w.a.T) @ w.b.T
    n = x.shape[0]
    padded = -(-n // INVARIANT_LORA_ROWS) * INVARIANT_LORA_ROWS
    if padded != n:
        x = torch.cat([x, x.new_zeros(padded - n, x.shape[1])])
    return torch.cat([(c @ w.a.T) @ w.b.T for c in x.split(INVARIANT_LORA_ROWS)])[:n]


def add_lora(y: torch.Tensor, x: torch.Tensor, loras: dict[int, LoRAWeights], rows: LoRARows,
             invariant: bool) -> torch.Tensor:
    """y (the layer's output, [T, out] or [..., out]) with each group's adapter delta added, from x
    (the layer's input); layers without that slot's adapter leave its rows as they are."""
    y2 = y.view(-1, y.shape[-1])
    x2 = x.reshape(-1, x.shape[-1]).float()
    for slot, index in rows.groups:
        w = loras.get(slot)
        if w is None:
            continue
        d = _delta(x2[index], w, invariant).to(y2.dtype)
        if isinstance(index, slice):
            y2[index] += d
        else:
            y2.index_add_(0, index, d)
    return y
