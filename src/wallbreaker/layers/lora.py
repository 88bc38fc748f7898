"""LoRA beside a linear layer's matmul, not merged into it: y = base(x) + (x Aᵀ) Bᵀ for the rows whose
sequence uses the adapter, each sequence its own adapter (vLLM's punica idea, in torch).

A layer holds every adapter slot's weights side by side in one `LoRAWeights` (lora/registry.py binds
them): slot s owns `width` columns of A's rows and B's columns, its fused segments' ranks each at a
fixed offset in them, the scale folded into B, zeros where a slot holds nothing. A step is then two
matmuls a layer whatever the number of adapters in it: h = x Aᵀ for every slot at once, masked to each
row's own slot's columns, and y += h Bᵀ. The masked columns are exact zeros, so a row without an
adapter gets y + 0 = y, and a row's bits depend only on its own slot's weights (the shapes are fixed
by `max_loras` and `max_lora_rank`, not by which adapters are loaded).

The layers of a model share one `LoRARows`, which the model runner sets each step (engine/
model_runner.py) as it sets `PromptRows`: each row's slot, or nothing when no row uses an adapter (the
layers then do no LoRA work at all)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

INVARIANT_LORA_ROWS = 16  # rows of every LoRA matmul call in batch-invariant mode (layers/linear.py)


@dataclass
class LoRAWeights:
    a: torch.Tensor  # [slots * width, in] float32
    b: torch.Tensor  # [out, slots * width] float32, the scale folded in
    width: int  # columns a slot owns


@dataclass
class LoRARows:
    """The step's rows' adapter slots ([T] int64, 0: none), or None between steps and in a step
    without adapters. One object shared by a model's layers."""

    slots: torch.Tensor | None = None
    _masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def set(self, slots: torch.Tensor | None) -> None:
        self.slots = slots
        self._masks = {}

    def mask(self, width: int, num_slots: int) -> torch.Tensor:
        """[T, num_slots * width] float32: 1 in each row's own slot's columns, else 0 (made once a step)."""
        key = (width, num_slots)
        found = self._masks.get(key)
        if found is None:
            owner = torch.arange(1, num_slots + 1, device=self.slots.device).repeat_interleave(width)
            found = self._masks[key] = (self.slots[:, None] == owner[None, :]).float()
        return found


def step_slots(pieces: list[tuple[int, int]], device: torch.device) -> torch.Tensor | None:
    """Each row's slot of a step whose consecutive row runs are `pieces`, (slot, rows) each; None
    where no row uses an adapter."""
    if not any(slot for slot, _ in pieces):
        return None
    return torch.tensor([slot for slot, n in pieces for _ in range(n)], dtype=torch.long, device=device)


def _delta(x: torch.Tensor, mask: torch.Tensor, w: LoRAWeights) -> torch.Tensor:
    return (x @ w.a.T).mul_(mask) @ w.b.T


def add_lora(y: torch.Tensor, x: torch.Tensor, w: LoRAWeights, rows: LoRARows, invariant: bool) -> torch.Tensor:
    """y (the layer's output, [..., out]) with each row's adapter delta added, from x (the layer's
    input). In batch-invariant mode the matmuls run in calls of exactly INVARIANT_LORA_ROWS rows."""
    y2 = y.view(-1, y.shape[-1])
    x2 = x.reshape(-1, x.shape[-1]).float()
    mask = rows.mask(w.width, w.a.shape[0] // w.width)
    if not invariant:
        y2 += _delta(x2, mask, w).to(y2.dtype)
        return y
    n = x2.shape[0]
    padded = -(-n // INVARIANT_LORA_ROWS) * INVARIANT_LORA_ROWS
    if padded != n:
        x2 = torch.cat([x2, x2.new_zeros(padded - n, x2.shape[1])])
        mask = torch.cat([mask, mask.new_zeros(padded - n, mask.shape[1])])
    for start in range(0, n, INVARIANT_LORA_ROWS):
        end = start + INVARIANT_LORA_ROWS
        d = _delta(x2[start:end], mask[start:end], w)
        y2[start:min(end, n)] += d[:min(end, n) - start].to(y2.dtype)
    return y
