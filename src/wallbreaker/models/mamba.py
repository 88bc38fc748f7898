"""Mamba (v1) and Falcon-Mamba (transformers' MambaForCausalLM, FalconMambaForCausalLM): embeddings, a
stack of pre-norm Mamba mixers with residuals, a final norm. No attention: each layer's state lives
in the state pool (layers/mamba.py)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..layers.attention import AttentionMetadata
from ..layers.direct import DirectModule
from ..layers.mamba import MambaMixer, MambaWeights
from .base import CausalLM, rms_norm
from .source import WeightSource


def mamba_mixer(cfg: ModelConfig, layer: int, src: WeightSource) -> MambaMixer:
    """Layer `layer`'s mixer: its projections through `src.linear`, the rest float32 (canonical names
    and layouts: formats/mamba_v1.py)."""
    p = f"blk.{layer}."

    def small(name: str) -> torch.Tensor:
        return src.weights[p + name].load().float()
    bias = src.weights.get(p + "ssm_conv1d.bias")
    weights = MambaWeights(small("ssm_conv1d.weight"), None if bias is None else bias.load().float(),
                           small("ssm_dt.weight"), small("ssm_dt.bias"), small("ssm_a"), small("ssm_d"))
    return MambaMixer(cfg, src.linear([p + "ssm_in.weight"]), src.linear([p + "ssm_x.weight"]),
                      src.linear([p + "ssm_out.weight"]), weights)


class MambaLayer(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        self.norm = rms_norm(src, f"blk.{layer}.attn_norm.weight", cfg.rms_norm_eps)
        self.mixer = mamba_mixer(cfg, layer, src)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self.mixer(self.norm.add_and_norm(h, delta), meta)


class MambaCausalLM(CausalLM):
    layer_class = MambaLayer
