"""Granite-4.0-H (transformers' GraniteMoeHybridForCausalLM, GGUF `granitehybrid`): pre-norm layers
whose mixer is either a Mamba2 mixer (layers/mamba2.py) or GQA attention, then an FFN: a mixture of
experts (models/moe.py's router and dispatch; Granite's top-k-then-softmax is the same as softmax,
top-k, renormalize) plus an always-on shared expert, or in a dense model the shared MLP alone.

Granite's four multipliers: the embeddings are scaled, each branch is scaled before its residual
add, the attention scale is `attention_multiplier` (not head_dim ** -0.5), and the logits are divided
by `logits_scaling`. Granite-4.0-H's attention has no positional encoding (`position_embedding_type`
"nope": the Mamba2 layers carry the order); plain RoPE is run where a config asks for it.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import _C
from ..config import ModelConfig
from ..layers.attention import AttentionMetadata
from ..layers.direct import DirectModule
from .base import CausalLM, rms_norm
from .llama import Attention
from .mamba2 import mamba2_mixer
from .moe import SparseMoE
from .source import WeightSource


class NoRope(nn.Module):
    """The rotation of attention without positional encoding: cos 1, sin 0 at every position."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.key = ("none", head_dim)
        self.attention_factor = 1.0

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (positions.shape[0], self.head_dim)
        return torch.ones(shape, device=positions.device), torch.zeros(shape, device=positions.device)


class GatedMLP(DirectModule):
    """SwiGLU over the named projections (Granite's shared expert, or a dense model's FFN)."""

    def __init__(self, src: WeightSource, prefix: str, suffix: str, act: str):
        super().__init__()
        self.gate_up = src.linear([f"{prefix}ffn_gate{suffix}.weight", f"{prefix}ffn_up{suffix}.weight"],
                                  parallel="column")
        self.down = src.linear([f"{prefix}ffn_down{suffix}.weight"], parallel="row")
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(_C.gated_act(self.gate_up(x), self.act))


class GraniteHybridLayer(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.attn_norm = rms_norm(src, p + "attn_norm.weight", cfg.rms_norm_eps)
        self.attn, self.mixer = None, None
        if cfg.is_attention(layer):
            self.attn = Attention(cfg, layer, src)
            if cfg.attention_multiplier is not None:
                self.attn.scale = cfg.attention_multiplier
            if not cfg.attention_rope:
                self.attn.rope = NoRope(cfg.head_dim)
        else:
            self.mixer = mamba2_mixer(cfg, layer, src)
        self.ffn_norm = rms_norm(src, p + "ffn_norm.weight", cfg.rms_norm_eps)
        self.moe = SparseMoE(cfg, layer, src) if cfg.is_moe else None
        self.mlp = GatedMLP(src, p, "_shexp" if cfg.is_moe else "", cfg.hidden_act)
        self.residual = cfg.residual_multiplier

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.attn_norm.add_and_norm(h, delta)
        mixed = self.attn(x, meta) if self.attn is not None else self.mixer(x, meta)
        x = self.ffn_norm.add_and_norm(h, mixed * self.residual)
        out = self.mlp(x)
        if self.moe is not None:
            out = self.moe(x) + out
        return h, out * self.residual


class GraniteHybridCausalLM(CausalLM):
    layer_class = GraniteHybridLayer

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.config.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().logits(hidden) / self.config.logits_scaling
