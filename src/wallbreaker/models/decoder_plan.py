"""A model's layer stack run from C++ on steps where every token goes to the paged attention kernel
(decode, speculative verification): `_C.DecoderPlan` (csrc/decoder_plan.cpp) calls the same ops
the layers' `forward` calls, in the same order, so the logits are bit-identical, without ~8 Python
calls a layer between the kernels (a tenth to a third of a small model's decode step).

A layer takes part through its `plan_spec()` (models/llama.py `block_spec`): its tensors, or None
where the plan cannot run it as its `forward` would; one such layer keeps the whole model on the
Python layers. `WALLBREAKER_DECODER_PLAN=0` turns the plan off (the A of an A/B).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from .. import _C
from .. import kernels as qk
from ..layers.attention import AttentionMetadata, LayerKV


class DecoderStackPlan:
    """The plan of one model's layers: built at its first step, rebuilt when the KV pool is bound
    anew (a layer's `attn.kv` is another object)."""

    def __init__(self, layers: nn.ModuleList):
        self.layers = layers
        self.enabled = os.environ.get("WALLBREAKER_DECODER_PLAN", "1") != "0" and all(
            getattr(layer, "plan_spec", None) is not None and layer.plan_spec() is not None for layer in layers)
        # read once: a submodule lookup costs about a microsecond, 30 of them a step
        self._attns = [layer.attn for layer in layers] if self.enabled else []
        self.dense = True  # calls of many rows may take the dense path (off: CausalLM.set_batch_invariant)
        self._plan: _C.DecoderPlan | None = None
        self._kv: list[LayerKV] = []
        self._ropes: list[nn.Module] = []  # the distinct RoPEs, in the order of `run`'s cos/sin lists

    def reset(self) -> None:
        """Build the plan again at the next step (the KV pool or a layer's LoRA weights are new)."""
        self._plan = None

    def run(self, h: torch.Tensor, meta: AttentionMetadata, lora_slots: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h, delta) after the last layer, from the embedded tokens h; None where this step is not
        for the plan (a prefill span, or the plan is off). `lora_slots`: each row's LoRA adapter slot
        where a row uses one (layers/lora.py)."""
        if not self.enabled or meta.prefills or meta.num_paged_tokens != meta.slot_mapping.shape[0]:
            return None
        plan = self._current()
        if plan is None:
            return None
        cos_sin = [meta.rotary(rope) for rope in self._ropes]
        dense_min_rows = qk.DENSE_MIN_ROWS if self.dense and qk.dense_path() else 0
        return plan.run(h, [c for c, _ in cos_sin], [s for _, s in cos_sin], meta.slot_mapping,
                        meta.block_tables, meta.query_start, meta.context_lens, meta.block_size, dense_min_rows,
                        qk.DENSE_TILE_ROWS, lora_slots)

    def _current(self) -> _C.DecoderPlan | None:
        kv = [attn.kv for attn in self._attns]
        if any(pages is None for pages in kv):
            return None
        if self._plan is None or any(a is not b for a, b in zip(kv, self._kv)):
            ropes: dict[int, nn.Module] = {}
            specs = []
            for layer, pages in zip(self.layers, kv):
                rope = ropes.setdefault(layer.attn.rope.key, layer.attn.rope)
                specs.append({**layer.plan_spec(), "kv": tuple(pages), "rope": list(ropes).index(rope.key)})
            self._plan, self._kv, self._ropes = _C.DecoderPlan(specs), kv, list(ropes.values())
        return self._plan
