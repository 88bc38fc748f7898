"""Mamba2 (transformers' Mamba2ForCausalLM): embeddings, a stack of pre-norm Mamba2 mixers with
residuals, a final norm. No attention at all, so the engine keeps no KV pages for it; each layer's
state lives in the state pool (layers/mamba2.py)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..layers.attention import AttentionMetadata
from ..layers.direct import DirectModule
from ..layers.mamba2 import Mamba2Mixer, Mamba2Weights
from .base import CausalLM, rms_norm
from .source import WeightSource


def mamba2_mixer(cfg: ModelConfig, layer: int, src: WeightSource) -> Mamba2Mixer:
    """Layer `layer`'s mixer: its projections through `src.linear` (our kernels on the packed path),
    the rest float32 (canonical names and layouts: formats/mamba.py)."""
    p = f"blk.{layer}."

    def small(name: str) -> torch.Tensor:
        return src.weights[p + name].load().float()
    bias = src.weights.get(p + "ssm_conv1d.bias")
    weights = Mamba2Weights(small("ssm_conv1d.weight"), None if bias is None else bias.load().float(), small("ssm_a"),
                            small("ssm_d"), small("ssm_dt.bias"), small("ssm_norm.weight"))
    return Mamba2Mixer(cfg, src.linear([p + "ssm_in.weight"]), src.linear([p + "ssm_out.weight"]), weights)


class Mamba2Layer(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        self.norm = rms_norm(src, f"blk.{layer}.attn_norm.weight", cfg.rms_norm_eps)
        self.mixer = mamba2_mixer(cfg, layer, src)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self.mixer(self.norm.add_and_norm(h, delta), meta)


class Mamba2CausalLM(CausalLM):
    layer_class = Mamba2Layer
