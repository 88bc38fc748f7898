"""Gemma 2 and 3: sandwich norms around attention and MLP, GeGLU, scaled embeddings, and
sliding-window layers between global ones; Gemma 2 soft-caps the attention scores and the final
logits, Gemma 3 has QK-norm and its sliding layers their own RoPE base. The config carries the
switches; this file only changes the shape of the block."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..layers.attention import AttentionMetadata
from ..layers.direct import DirectModule
from .base import CausalLM, rms_norm
from .llama import Attention, block_spec, feed_forward
from .source import WeightSource


class GemmaDecoderLayer(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p, eps = f"blk.{layer}.", cfg.rms_norm_eps
        self.attn_norm = rms_norm(src, p + "attn_norm.weight", eps)
        self.attn = Attention(cfg, layer, src)
        self.post_attn_norm = rms_norm(src, p + "post_attention_norm.weight", eps)
        self.mlp_norm = rms_norm(src, p + "ffn_norm.weight", eps)
        self.mlp = feed_forward(cfg, layer, src)
        self.post_mlp_norm = rms_norm(src, p + "post_ffw_norm.weight", eps)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.post_attn_norm(self.attn(self.attn_norm.add_and_norm(h, delta), meta))
        return h, self.post_mlp_norm(self.mlp(self.mlp_norm.add_and_norm(h, attn)))

    def plan_spec(self) -> dict | None:
        return block_spec(self.attn_norm, self.attn, self.mlp_norm, self.mlp, self.post_attn_norm, self.post_mlp_norm)


class GemmaCausalLM(CausalLM):
    layer_class = GemmaDecoderLayer
