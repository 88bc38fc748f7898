"""Mamba2 (transformers' Mamba2ForCausalLM): embeddings, a stack of pre-norm Mamba2 mixers with
residuals, a final norm. No attention at all, so the engine keeps no KV pages for it; each layer's
state lives in the state pool (layers/mamba2.py)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..layers.attention import AttentionMetadata
from ..layers.direct import DirectModule
from ..layers.mamba2 import Mamba2Mixer
from .base import CausalLM, rms_norm
from .source import WeightSource


class Mamba2Layer(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        self.norm = rms_norm(src, f"blk.{layer}.attn_norm.weight", cfg.rms_norm_eps)
        self.mixer = Mamba2Mixer(cfg, layer, src)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self.mixer(self.norm.add_and_norm(h, delta), meta)


class Mamba2CausalLM(CausalLM):
    layer_class = Mamba2Layer
