"""Running a model one decoder layer at a time over calibration sequences.

GPTQ and AWQ quantize layer by layer and feed each layer the outputs of the layers already
quantized (the reference recipe): activations for one layer at a time, instead of every layer's at
once, which would not fit in memory for the larger models. The layers run through their own
`forward`, with a scratch KV cache (one block per sequence) bound to their attention while they run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import AttentionMetadata, LayerKV, PrefillSpan


@dataclass
class LinearGroup:
    """A Linear module of a decoder layer and the canonical tensors fused in its rows."""

    name: str  # "qkv" | "o" | "gate_up" | "down"
    module: nn.Module
    parts: list[tuple[str, int, int]]  # (canonical name, first row, end row)


def linear_groups(model: nn.Module, i: int) -> list[LinearGroup]:
    """The four Linear modules of layer `i`, in the order their inputs are computed."""
    cfg = model.config
    layer, p = model.layers[i], f"blk.{i}."
    q, kv, ff = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return [
        LinearGroup("qkv", layer.attn.qkv, [(p + "attn_q.weight", 0, q), (p + "attn_k.weight", q, q + kv),
                                            (p + "attn_v.weight", q + kv, q + 2 * kv)]),
        LinearGroup("o", layer.attn.o, [(p + "attn_output.weight", 0, cfg.hidden_size)]),
        LinearGroup("gate_up", layer.mlp.gate_up, [(p + "ffn_gate.weight", 0, ff), (p + "ffn_up.weight", ff, 2 * ff)]),
        LinearGroup("down", layer.mlp.down, [(p + "ffn_down.weight", 0, cfg.hidden_size)]),
    ]


class LayerRunner:
    """Runs decoder layers of `model` on a batch of equal-length sequences, `batch` at a time."""

    def __init__(self, model: nn.Module, seqlen: int, batch: int = 8):
        cfg = model.config
        self.model, self.seqlen, self.batch = model, seqlen, batch
        shape = (cfg.num_kv_heads, batch * seqlen, cfg.head_dim)  # [kv_heads, slots, head_dim]: one block a sequence
        self._k, self._v = torch.zeros(shape), torch.zeros(shape)

    def _meta(self, n: int) -> AttentionMetadata:
        L = self.seqlen
        positions = torch.arange(L).repeat(n)  # [n·L]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n * L),
            block_tables=torch.zeros(0, 1, dtype=torch.int32), query_start=torch.zeros(1, dtype=torch.int32),
            context_lens=torch.zeros(0, dtype=torch.int32),
            prefills=[PrefillSpan(j * L, L, L, torch.tensor([j])) for j in range(n)], positions=positions,
            block_size=L, num_paged_tokens=0)
        return meta

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[N, L] token ids -> [N, L, hidden]: what the first layer receives."""
        return self.model.embed_tokens(ids.reshape(-1)).view(ids.shape[0], self.seqlen, -1)

    @torch.no_grad()
    def run(self, i: int, hidden: torch.Tensor, samples: int | None = None) -> torch.Tensor:
        """Layer `i` on [N, L, hidden] (the first `samples` sequences only, if given) -> its output."""
        layer = self.model.layers[i]
        attn = layer.attn
        saved = attn.kv
        attn.kv = LayerKV(self._k, self._v)
        hidden = hidden[:samples] if samples else hidden
        outs = []
        try:
            for start in range(0, hidden.shape[0], self.batch):
                chunk = hidden[start:start + self.batch]
                meta = self._meta(chunk.shape[0])
                h, delta = layer(chunk.reshape(-1, chunk.shape[-1]).float().clone(), meta)
                outs.append(h + delta)
        finally:
            attn.kv = saved
        return torch.cat(outs).view(hidden.shape)
