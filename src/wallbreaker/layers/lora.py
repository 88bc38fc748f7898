"""LoRA beside a linear layer's matmul, not merged into it: y = base(x) + (x Aᵀ) Bᵀ for the rows whose
sequence uses the adapter, each sequence its own adapter (vLLM's punica idea).

A layer holds every adapter slot's weights side by side in one `LoRAWeights` (lora/registry.py binds
them): slot s owns `width` rows of A and of Bᵀ, its fused segments' ranks each at a fixed offset in
them, the scale folded into Bᵀ, zeros where a slot holds nothing. `_C.lora_add_` (csrc/lora_ops.cpp)
adds each row's own slot's product and leaves rows without an adapter as they are; a row's bits depend
only on its own input and slot, so the same call serves batch-invariant mode.

The layers of a model share one `LoRARows`, which the model runner sets each step (engine/
model_runner.py) as it sets `PromptRows`: each row's slot, or nothing when no row uses an adapter (the
layers then do no LoRA work at all)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _C


@dataclass
class LoRAWeights:
    a: torch.Tensor  # [slots * width, in] float32
    b_t: torch.Tensor  # [slots * width, out] float32: Bᵀ, the scale folded in
    width: int  # columns a slot owns


@dataclass
class LoRARows:
    """The step's rows' adapter slots ([T] int64, 0: none), or None between steps and in a step
    without adapters. One object shared by a model's layers."""

    slots: torch.Tensor | None = None

    def set(self, slots: torch.Tensor | None) -> None:
        self.slots = slots


def step_slots(pieces: list[tuple[int, int]], device: torch.device) -> torch.Tensor | None:
    """Each row's slot of a step whose consecutive row runs are `pieces`, (slot, rows) each; None
    where no row uses an adapter."""
    if not any(slot for slot, _ in pieces):
        return None
    return torch.tensor([slot for slot, n in pieces for _ in range(n)], dtype=torch.long, device=device)


def add_lora(y: torch.Tensor, x: torch.Tensor, w: LoRAWeights, rows: LoRARows) -> torch.Tensor:
    """y (the layer's output, [..., out]) with each row's adapter delta added, from x (the layer's input)."""
    y2 = y.view(-1, y.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    if y2.dtype == torch.float32:
        _C.lora_add_(y2, x2, w.a, w.b_t, rows.slots, w.width)
        return y
    delta = torch.zeros(y2.shape, dtype=torch.float32)
    _C.lora_add_(delta, x2, w.a, w.b_t, rows.slots, w.width)
    y2 += delta.to(y2.dtype)
    return y
